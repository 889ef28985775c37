// Warp-level tensor-core building blocks for sm80 and later: cp.async tile
// loads, ldmatrix fragment loads and mma.sync m16n8k16 (fp16/bf16 in, fp32
// accumulate), written as inline PTX so the kernels depend on nothing but the
// CUDA runtime.
//
// Fragment conventions (PTX ISA, "mma.m16n8k16"): a lane is (g, t) with
// g = lane / 4 and t = lane % 4.
//   A (16x16, row-major)  4 regs: (g, 2t..), (g+8, 2t..), (g, 2t+8..), (g+8, 2t+8..)
//   B (16x8,  "col")      2 regs: (k = 2t.., n = g), (k = 2t+8.., n = g)
//   C (16x8,  fp32)       4 floats: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
// Each 32-bit register holds two consecutive-k (A, B) elements.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace jaxflash {
namespace tc {

// ------------------------------------------------------------ element types
// Maps the storage type to the PTX type name and a pair-packing conversion.
template <typename T>
struct ElemTraits;

template <>
struct ElemTraits<__half> {
  __device__ __forceinline__ static uint32_t Pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static float ToFloat(__half x) { return __half2float(x); }
  __device__ __forceinline__ static __half FromFloat(float x) { return __float2half_rn(x); }
};

template <>
struct ElemTraits<__nv_bfloat16> {
  __device__ __forceinline__ static uint32_t Pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ __forceinline__ static float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
  __device__ __forceinline__ static __nv_bfloat16 FromFloat(float x) { return __float2bfloat16_rn(x); }
};

// ------------------------------------------------------------ mma.sync
// D = A * B + D for one m16n8k16 tile.
template <typename T>
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void Mma<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void Mma<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                   uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Scores are scaled into log2 units so the softmax can use exp2.
constexpr float kLog2e = 1.4426950408889634f;

// Sets accumulator tiles (one float[4] per m16n8 tile, the layout above) to zero.
template <int kTiles>
__device__ __forceinline__ void Zero(float (&d)[kTiles][4]) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) d[i][j] = 0.f;
}

// ------------------------------------------------------------ ldmatrix
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lane l supplies the row address of matrix l / 8,
// row l % 8, and receives one 32-bit element pair of each matrix.
__device__ __forceinline__ void Ldmatrix4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Same, each matrix transposed on the way to registers: used when the
// reduction index of an operand is the row index of its shared-memory tile.
__device__ __forceinline__ void Ldmatrix4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Address helpers for a row-major tile with `stride` elements per row
// (`stride` is padded so that 8 consecutive rows start in 8 different 16-byte
// bank groups, which makes every ldmatrix below conflict-free).
//
// A fragment (16 rows x 16 k) whose rows are tile rows [r0, r0+16) and k is the
// tile column range [c0, c0+16): non-transposed load.
template <typename T>
__device__ __forceinline__ uint32_t AFragAddr(const T* tile, int stride, int r0, int c0, int lane) {
  const int row = r0 + (lane & 7) + ((lane >> 3) & 1) * 8;
  const int col = c0 + (lane >> 4) * 8;
  return SmemAddr(tile + row * stride + col);
}

// Two B fragments (n-tiles [n0, n0+8) and [n0+8, n0+16), k range [c0, c0+16))
// from a tile whose rows are n and columns are k (e.g. K for Q·Kᵀ):
// non-transposed load; regs {0,1} are n-tile 0, {2,3} n-tile 1.
// The element (row, col) whose 16-byte chunk lane `lane` addresses is
// BFragCoordNK (a tile in another layout, such as the TMA's swizzled one,
// maps it to its own address).
struct FragCoord {
  int row, col;
};
__device__ __forceinline__ FragCoord BFragCoordNK(int n0, int c0, int lane) {
  return {n0 + (lane & 7) + (lane >> 4) * 8, c0 + ((lane >> 3) & 1) * 8};
}
template <typename T>
__device__ __forceinline__ uint32_t BFragAddrNK(const T* tile, int stride, int n0, int c0, int lane) {
  const FragCoord f = BFragCoordNK(n0, c0, lane);
  return SmemAddr(tile + f.row * stride + f.col);
}

// Two B fragments from a tile whose rows are k and columns are n (e.g. V for
// P·V): transposed load of rows [k0, k0+16), columns [n0, n0+16);
// regs {0,1} are n-tile [n0, n0+8), {2,3} n-tile [n0+8, n0+16).
__device__ __forceinline__ FragCoord BFragCoordKN(int k0, int n0, int lane) {
  return {k0 + (lane & 7) + ((lane >> 3) & 1) * 8, n0 + (lane >> 4) * 8};
}
template <typename T>
__device__ __forceinline__ uint32_t BFragAddrKN(const T* tile, int stride, int k0, int n0, int lane) {
  const FragCoord f = BFragCoordKN(k0, n0, lane);
  return SmemAddr(tile + f.row * stride + f.col);
}

// A fragment (16 m x 16 k) from a tile stored transposed, rows are k and
// columns are m (e.g. dSᵀ kept as [key][query] when computing dQ = dS·K):
// transposed load.
template <typename T>
__device__ __forceinline__ uint32_t AFragAddrKM(const T* tile, int stride, int m0, int k0, int lane) {
  const int row = k0 + (lane & 7) + (lane >> 4) * 8;
  const int col = m0 + ((lane >> 3) & 1) * 8;
  return SmemAddr(tile + row * stride + col);
}

// ------------------------------------------------------------ cp.async
// 16-byte global->shared copy; when `valid` is false the 16 shared bytes are
// zero-filled and global memory is not read (src-size 0), which is how tiles
// that run past the sequence or the head dimension are padded.
__device__ __forceinline__ void CpAsync16(uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_bytes));
}

__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }

// 4-byte variant (per-row float vectors such as LSE); zero-filled when invalid.
__device__ __forceinline__ void CpAsync4(uint32_t smem_addr, const void* gmem, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_bytes));
}

template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Threads a tile loader gives each row: the row's 16-byte chunks rounded up
// to a power of two, so that a thread count is a multiple of it; slots past
// the row's chunks stay idle.
__host__ __device__ constexpr int ChunkSlots(int chunks_per_row) {
  return chunks_per_row <= 4 ? 4 : chunks_per_row <= 8 ? 8 : chunks_per_row <= 16 ? 16 : 32;
}

// Copies rows [0, kRows) x columns [0, kCols) of a global tile (row stride
// `gstride` elements) into shared memory (row stride `sstride`), 16 bytes per
// copy, spread over kThreads threads. Rows >= `rows_valid` and columns >=
// `cols_valid` are zero-filled. `cols_valid` is a multiple of 8.
//
// Each thread owns one 16-byte column chunk and walks rows with a fixed step,
// advancing a single pointer: written this way the compiler keeps one address
// live instead of hoisting one per copy out of the caller's main loop (which
// costs dozens of registers).
template <int kRows, int kCols, int kThreads, typename T>
__device__ __forceinline__ void LoadTile(T* smem, int sstride, const T* gmem, int64_t gstride,
                                         int rows_valid, int cols_valid, int tid) {
  static_assert(kCols % 8 == 0, "tile width must be a multiple of 8 elements");
  constexpr int kChunksPerRow = kCols / 8;
  constexpr int kSlots = ChunkSlots(kChunksPerRow);
  static_assert(kThreads % kSlots == 0, "thread count must cover whole rows");
  constexpr int kRowStep = kThreads / kSlots;
  const int chunk = tid % kSlots;
  if (kSlots != kChunksPerRow && chunk >= kChunksPerRow) return;
  const int row = tid / kSlots;
  const int col = chunk * 8;
  const bool col_ok = col < cols_valid;
  const T* src = gmem + row * gstride + col;
  const uint32_t dst = SmemAddr(smem + row * sstride + col);
  const int64_t src_step = kRowStep * gstride;
#pragma unroll
  for (int it = 0; it < (kRows + kRowStep - 1) / kRowStep; ++it) {
    if (kRows % kRowStep != 0 && row + it * kRowStep >= kRows) break;
    // An invalid chunk passes src-size 0: nothing is read from `src`.
    CpAsync16(dst + it * kRowStep * sstride * int(sizeof(T)), src, col_ok && row + it * kRowStep < rows_valid);
    src += src_step;
  }
}

// ------------------------------------------------------------ math
// exp2 on the special-function unit (relative error ~2^-22); -inf gives 0.
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// x, with its origin hidden from the compiler (an empty asm), so what is
// derived from it is computed where it is used instead of hoisted out of a
// loop and held, or spilled, across it: for values cheap to rebuild in a
// kernel that is short of registers. 32-bit integers.
template <typename I>
__device__ __forceinline__ I Unhoisted(I x) {
  static_assert(sizeof(I) == 4, "a 32-bit register");
  asm volatile("" : "+r"(x));
  return x;
}

// max that propagates NaN (fmaxf drops it, same cost): a NaN score must make
// its row's running max NaN, or a row whose every score is NaN would look like
// a row that has seen nothing yet.
__device__ __forceinline__ float MaxNaN(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

// ------------------------------------------------------------ warp reductions
// The four lanes of a quad (same g) own the same accumulator rows.
__device__ __forceinline__ float QuadMax(float x) {
  x = MaxNaN(x, __shfl_xor_sync(0xffffffffu, x, 1));
  x = MaxNaN(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return x;
}
__device__ __forceinline__ float QuadSum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x;
}
__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

}  // namespace tc
}  // namespace jaxflash
