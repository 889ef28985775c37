// Warpgroup-level tensor-core building blocks for Hopper (sm_90a): shared
// memory descriptors, the 128-byte swizzled tile layout they describe, and
// wgmma.mma_async m64nNk16 (fp16/bf16 in, fp32 accumulate) as inline PTX.
//
// A warpgroup is four consecutive warps (128 threads); one wgmma computes a
// 64 x N block. Warp w of the group owns rows [16w, 16w + 16) of it and its
// accumulator fragment is exactly the mma.sync m16n8 C layout repeated over
// N / 8 column tiles (mma.cuh): float d[nt][4] holds (g, 8nt + 2t..) and
// (g + 8, 8nt + 2t..). The A operand taken from registers has the mma.sync
// m16n8k16 A layout, so scores convert to the P operand without shuffles.
//
// Everything here is only meaningful when compiled for sm_90a; callers guard
// their kernel bodies with JAXFLASH_SM90A.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/mma.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAXFLASH_SM90A 1
#endif

namespace jaxflash {
namespace sm90 {

// ------------------------------------------------------------ tile layout
// A tile of kRows rows x kCols bf16/fp16 columns is stored as kCols / 64
// column blocks of kRows x 128 bytes; inside a block, the 16-byte chunk c of
// row r sits at chunk position c ^ (r % 8). That is the hardware's 128-byte
// swizzle (address bits [4, 7) XOR bits [7, 10)), so the same bytes are read
// by wgmma through a descriptor, and 8 consecutive rows of one chunk column
// land in 8 different bank groups. Blocks must start 1024-byte aligned.
template <int kRows, int kCols>
struct SwizzledTile {
  static_assert(kCols % 64 == 0 && kRows % 8 == 0, "tiles are whole 8 x 64 swizzle atoms");
  static constexpr int kBlocks = kCols / 64;
  static constexpr int kBlockBytes = kRows * 128;
  static constexpr int kBytes = kBlocks * kBlockBytes;

  // Byte offset of the 16-byte chunk holding columns [8c, 8c + 8) of row r.
  __device__ __forceinline__ static uint32_t ChunkOffset(int r, int c) {
    return (c >> 3) * kBlockBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4);
  }
};

// Zeroes rows [first, kRows) of a SwizzledTile with kThreads threads (the 32
// lanes of a warp unless told; `index` is the caller's among them): the
// padding rows of a ragged batch element that a TMA copy brought in (its
// zero fill covers only rows past the tensor), so a NaN there meets a masked
// pair's zero weight in no product. Whole 128-byte rows, so the swizzle does
// not matter, and in each column block one contiguous range of bytes (walked
// without a division: the producers run in 24-32 registers). The caller
// fences for the async proxy.
template <typename Tile, int kThreads = 32>
__device__ __forceinline__ void ZeroTileRows(uint32_t tile, int first, int index) {
#pragma unroll 1
  for (int b = 0; b < Tile::kBlocks; ++b) {
    const uint32_t block = tile + b * Tile::kBlockBytes;
#pragma unroll 1
    for (uint32_t at = block + first * 128 + index * 16; at < block + Tile::kBlockBytes; at += kThreads * 16) {
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(at), "r"(0) : "memory");
    }
  }
}

// Copies rows [0, kRows) x columns [0, kCols) of a global tile (row stride
// `gstride` elements) into a SwizzledTile at shared address `smem`, spread
// over kThreads threads; rows >= rows_valid and columns >= cols_valid are
// zero-filled (cols_valid is a multiple of 8). Consecutive threads read
// consecutive 16-byte chunks of a row, so the global reads are coalesced.
template <int kRows, int kCols, int kThreads, typename T>
__device__ __forceinline__ void LoadSwizzledTile(uint32_t smem, const T* gmem, int64_t gstride, int rows_valid,
                                                 int cols_valid, int tid) {
  using Tile = SwizzledTile<kRows, kCols>;
  constexpr int kChunksPerRow = kCols / 8;
  static_assert(kThreads % kChunksPerRow == 0, "thread count must cover whole rows");
  constexpr int kRowStep = kThreads / kChunksPerRow;
  const int chunk = tid % kChunksPerRow;
  const int row = tid / kChunksPerRow;
  const bool col_ok = chunk * 8 < cols_valid;
  const T* src = gmem + row * gstride + chunk * 8;
  const uint32_t dst = smem + Tile::ChunkOffset(row, chunk);
#pragma unroll
  for (int it = 0; it < (kRows + kRowStep - 1) / kRowStep; ++it) {
    const int r = row + it * kRowStep;
    if (kRows % kRowStep != 0 && r >= kRows) break;
    // With a row step that is a multiple of 8 every row this thread visits has
    // the same swizzle phase, and the destination moves by a constant.
    const uint32_t at = kRowStep % 8 == 0 ? dst + it * kRowStep * 128 : smem + Tile::ChunkOffset(r, chunk);
    tc::CpAsync16(at, src, col_ok && r < rows_valid);
    src += kRowStep * gstride;
  }
}

// ------------------------------------------------------------ descriptors
// The 64-bit shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor
// Format") of a SwizzledTile: start address and leading byte offset (>> 4) in
// the low word; the stride byte offset (1024: 8-row groups) and the 128-byte
// swizzle mode in the high word, which is therefore the same for every
// descriptor here. Only the low word is computed at run time and the wgmma
// wrappers below pair it with the constant: a descriptor then costs one add
// and one move to a uniform register, not a 64-bit build per k step.
#define JAXFLASH_DESC_HI "0x40000040"  // (1024 >> 4) | (1 << 30)
__device__ __forceinline__ uint32_t DescriptorLo(uint32_t smem_addr, uint32_t leading_bytes) {
  return ((smem_addr & 0x3FFFF) >> 4) | ((leading_bytes >> 4) << 16);
}

// A value the same in every lane of a warp, marked so for the compiler: read
// from lane 0, it can live in a uniform register. The operands' tile
// addresses (a warpgroup's rows, a stage, a dS buffer) are the same across a
// warp, but derived from threadIdx or from a loop the compiler cannot tell;
// marked, their descriptors are built by the uniform datapath next to each
// wgmma. Unmarked, every descriptor took two moves into uniform registers,
// and the fused backward's step issued 112 of them (docs/performance.md,
// twenty-sixth session).
template <typename V>
__device__ __forceinline__ V WarpUniform(V v) {
  return __shfl_sync(0xffffffffu, v, 0);
}

// K-major operand (rows are M or N, columns are the reduction index k), the
// 16 columns [16 kk, 16 kk + 16): 8-row groups are 1024 bytes apart; inside a
// swizzle atom the k step is a 32-byte move of the start address (the hardware
// applies the swizzle to the final address). The leading offset is unused.
template <typename Tile>
__device__ __forceinline__ uint32_t KMajorDescriptor(uint32_t tile, int kk) {
  return DescriptorLo(tile, 16) + (((kk >> 2) * Tile::kBlockBytes + (kk & 3) * 32) >> 4);
}

// MN-major operand (rows are the reduction index k, columns are N; e.g. V for
// P·V), rows [16 kk, 16 kk + 16) and columns [n0, n0 + N): the leading offset
// steps between 64-column blocks, the stride offset between 8-row groups;
// n0 is a multiple of 64 (a column block).
template <typename Tile>
__device__ __forceinline__ uint32_t MnMajorDescriptor(uint32_t tile, int kk, int n0) {
  return DescriptorLo(tile, Tile::kBlockBytes) + (((n0 >> 6) * Tile::kBlockBytes + kk * 16 * 128) >> 4);
}

// ------------------------------------------------------------ ordering
// Register and shared-memory writes by ordinary instructions must be fenced
// before a wgmma reads them (wgmma.fence), and shared memory written through
// the generic proxy (cp.async, st.shared) before the async proxy reads it.
__device__ __forceinline__ void WgmmaFence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void WgmmaCommit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void WgmmaWait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void FenceSharedForAsyncProxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The accumulator registers are written by the tensor cores until the wait
// returns; re-defining them in an empty volatile statement after the wait
// keeps the compiler from moving any read of them above it.
template <int kTiles>
__device__ __forceinline__ void FenceAccumulator(float (&d)[kTiles][4]) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(d[i][j])::"memory");
}

// ------------------------------------------------------------ wgmma
// Compiled for N = 32, 48, 64, 80, 96, 112, 128 and 176 (80 and 176: the
// forward's key tiles at head dims 256 and 64/128, the widest whose scores fit
// the registers; 96 and 112 D 192's; 48 the D 192 dQ pass's key steps).
// Wgmma<T, N>::SS: d (+)= A·B with A (64 x 16) and B (16 x N) both K-major in
// shared memory (descriptor low words, see above); RS: d += A·B with A from registers (mma.sync A fragment of
// this warp's 16 rows) and B MN-major in shared memory. `accumulate` false
// overwrites d (the first k step of a fresh product).
template <typename T, int N>
struct Wgmma;

#define JAXFLASH_ACC4(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3])
#define JAXFLASH_ACC16(i) JAXFLASH_ACC4(i), JAXFLASH_ACC4(i + 4), JAXFLASH_ACC4(i + 8), JAXFLASH_ACC4(i + 12)
#define JAXFLASH_ACC32 JAXFLASH_ACC16(0), JAXFLASH_ACC16(16)
#define JAXFLASH_ACC64 JAXFLASH_ACC32, JAXFLASH_ACC16(32), JAXFLASH_ACC16(48)
#define JAXFLASH_ACC40 JAXFLASH_ACC32, JAXFLASH_ACC4(32), JAXFLASH_ACC4(36)
#define JAXFLASH_ACC88 JAXFLASH_ACC64, JAXFLASH_ACC16(64), JAXFLASH_ACC4(80), JAXFLASH_ACC4(84)
#define JAXFLASH_ACC24 JAXFLASH_ACC16(0), JAXFLASH_ACC4(16), JAXFLASH_ACC4(20)
#define JAXFLASH_ACC48 JAXFLASH_ACC32, JAXFLASH_ACC16(32)
#define JAXFLASH_ACC56 JAXFLASH_ACC48, JAXFLASH_ACC4(48), JAXFLASH_ACC4(52)

// Operand lists: the N/2 accumulators are %0 .. %(N/2 - 1); the other
// operands follow them.
#define JAXFLASH_REGS16 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}"
#define JAXFLASH_REGS32                                                                         \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24," \
  "%25,%26,%27,%28,%29,%30,%31}"
#define JAXFLASH_REGS40 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39}"
#define JAXFLASH_REGS24 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23}"
#define JAXFLASH_REGS48 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47}"
#define JAXFLASH_REGS56 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55}"
#define JAXFLASH_REGS88 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87}"
#define JAXFLASH_REGS64                                                                         \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24," \
  "%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"  \
  "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"

// One specialisation per (element type, N). The operands after the N/2
// accumulators are numbered from N/2 on, and PTX wants those numbers as
// literals: SS, SSMn and SSMnAB take desc A (A0), desc B (B0) and the
// accumulate flag (F0), the accumulators last (a list, hence variadic), SSMn
// reading B MN-major and SSMnAB both operands (the last two immediates: the
// transpose bits of A and B); RS takes the four A registers (AREGS), desc B
// (B1) and the flag (F1), and reads B MN-major, RSK the same with B K-major.
#define JAXFLASH_WGMMA_SS(NAME, TRANSPOSE_A, TRANSPOSE_B, PTX, N, REGS, A0, B0, F0, ...)                      \
  __device__ __forceinline__ static void NAME(float (&d)[N / 2], uint32_t a, uint32_t b, bool accumulate) {   \
    asm volatile("{\n.reg .pred p;\n.reg .b64 da, db;\nsetp.ne.b32 p, " F0 ", 0;\n"                           \
                 "mov.b64 da, {" A0 ", " JAXFLASH_DESC_HI "};\nmov.b64 db, {" B0 ", " JAXFLASH_DESC_HI "};\n" \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " " REGS ", da, db"            \
                 ", p, 1, 1, " TRANSPOSE_A ", " TRANSPOSE_B ";\n}\n"                                          \
                 : __VA_ARGS__                                                                                \
                 : "r"(a), "r"(b), "r"(int(accumulate)));                                                     \
  }
#define JAXFLASH_WGMMA_RS(NAME, TRANSPOSE_B, PTX, N, REGS, AREGS, B1, F1, ...)                             \
  __device__ __forceinline__ static void NAME(float (&d)[N / 2], const uint32_t (&a)[4], uint32_t b,       \
                                              bool accumulate) {                                           \
    asm volatile("{\n.reg .pred p;\n.reg .b64 db;\nsetp.ne.b32 p, " F1 ", 0;\n"                              \
                 "mov.b64 db, {" B1 ", " JAXFLASH_DESC_HI "};\n"                                                 \
                 "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX "." PTX " " REGS ", " AREGS ", db"         \
                 ", p, 1, 1, " TRANSPOSE_B ";\n}\n"                                                             \
                 : __VA_ARGS__                                                                             \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b), "r"(int(accumulate)));              \
  }
#define JAXFLASH_WGMMA(CTYPE, PTX, N, REGS, ACC, A0, B0, F0, AREGS, B1, F1)                               \
  template <>                                                                                         \
  struct Wgmma<CTYPE, N> {                                                                            \
    JAXFLASH_WGMMA_SS(SS, "0", "0", PTX, N, REGS, A0, B0, F0, ACC)                                    \
    JAXFLASH_WGMMA_SS(SSMn, "0", "1", PTX, N, REGS, A0, B0, F0, ACC)                                  \
    JAXFLASH_WGMMA_SS(SSMnAB, "1", "1", PTX, N, REGS, A0, B0, F0, ACC)                                \
    JAXFLASH_WGMMA_RS(RS, "1", PTX, N, REGS, AREGS, B1, F1, ACC)                                      \
    JAXFLASH_WGMMA_RS(RSK, "0", PTX, N, REGS, AREGS, B1, F1, ACC)                                     \
  };

JAXFLASH_WGMMA(__nv_bfloat16, "bf16", 32, JAXFLASH_REGS16, JAXFLASH_ACC16(0), "%16", "%17", "%18", "{%16,%17,%18,%19}", "%20", "%21")
JAXFLASH_WGMMA(__half, "f16", 32, JAXFLASH_REGS16, JAXFLASH_ACC16(0), "%16", "%17", "%18", "{%16,%17,%18,%19}", "%20", "%21")
JAXFLASH_WGMMA(__nv_bfloat16, "bf16", 64, JAXFLASH_REGS32, JAXFLASH_ACC32, "%32", "%33", "%34", "{%32,%33,%34,%35}", "%36", "%37")
JAXFLASH_WGMMA(__half, "f16", 64, JAXFLASH_REGS32, JAXFLASH_ACC32, "%32", "%33", "%34", "{%32,%33,%34,%35}", "%36", "%37")
JAXFLASH_WGMMA(__nv_bfloat16, "bf16", 80, JAXFLASH_REGS40, JAXFLASH_ACC40, "%40", "%41", "%42", "{%40,%41,%42,%43}", "%44", "%45")
JAXFLASH_WGMMA(__half, "f16", 80, JAXFLASH_REGS40, JAXFLASH_ACC40, "%40", "%41", "%42", "{%40,%41,%42,%43}", "%44", "%45")
JAXFLASH_WGMMA(__nv_bfloat16, "bf16", 48, JAXFLASH_REGS24, JAXFLASH_ACC24, "%24", "%25", "%26", "{%24,%25,%26,%27}", "%28", "%29")
JAXFLASH_WGMMA(__half, "f16", 48, JAXFLASH_REGS24, JAXFLASH_ACC24, "%24", "%25", "%26", "{%24,%25,%26,%27}", "%28", "%29")
JAXFLASH_WGMMA(__nv_bfloat16, "bf16", 96, JAXFLASH_REGS48, JAXFLASH_ACC48, "%48", "%49", "%50", "{%48,%49,%50,%51}", "%52", "%53")
JAXFLASH_WGMMA(__half, "f16", 96, JAXFLASH_REGS48, JAXFLASH_ACC48, "%48", "%49", "%50", "{%48,%49,%50,%51}", "%52", "%53")
JAXFLASH_WGMMA(__nv_bfloat16, "bf16", 112, JAXFLASH_REGS56, JAXFLASH_ACC56, "%56", "%57", "%58", "{%56,%57,%58,%59}", "%60", "%61")
JAXFLASH_WGMMA(__half, "f16", 112, JAXFLASH_REGS56, JAXFLASH_ACC56, "%56", "%57", "%58", "{%56,%57,%58,%59}", "%60", "%61")
JAXFLASH_WGMMA(__nv_bfloat16, "bf16", 128, JAXFLASH_REGS64, JAXFLASH_ACC64, "%64", "%65", "%66", "{%64,%65,%66,%67}", "%68", "%69")
JAXFLASH_WGMMA(__half, "f16", 128, JAXFLASH_REGS64, JAXFLASH_ACC64, "%64", "%65", "%66", "{%64,%65,%66,%67}", "%68", "%69")
JAXFLASH_WGMMA(__nv_bfloat16, "bf16", 176, JAXFLASH_REGS88, JAXFLASH_ACC88, "%88", "%89", "%90", "{%88,%89,%90,%91}", "%92", "%93")
JAXFLASH_WGMMA(__half, "f16", 176, JAXFLASH_REGS88, JAXFLASH_ACC88, "%88", "%89", "%90", "{%88,%89,%90,%91}", "%92", "%93")

#undef JAXFLASH_WGMMA
#undef JAXFLASH_WGMMA_SS
#undef JAXFLASH_DESC_HI
#undef JAXFLASH_REGS88
#undef JAXFLASH_REGS48
#undef JAXFLASH_REGS24
#undef JAXFLASH_REGS56
#undef JAXFLASH_REGS64
#undef JAXFLASH_REGS40
#undef JAXFLASH_REGS32
#undef JAXFLASH_REGS16
#undef JAXFLASH_ACC88
#undef JAXFLASH_ACC56
#undef JAXFLASH_ACC48
#undef JAXFLASH_ACC24
#undef JAXFLASH_ACC64
#undef JAXFLASH_ACC40
#undef JAXFLASH_ACC32
#undef JAXFLASH_ACC16
#undef JAXFLASH_ACC4

// ------------------------------------------------------------ whole products
// The loops every kernel issues (callers fence before and commit after).
//
// d = A·Bᵀ over a reduction of kK columns: A is the 64 rows at `a` of a
// K-major ATile (a warpgroup's row block), B the kN rows of the K-major BTile
// at `b`; d is this warp's share of the 64 x kN accumulator.
template <typename T, typename ATile, typename BTile, int kK, int kN>
__device__ __forceinline__ void ProductSS(float (&d)[kN / 8][4], uint32_t a, uint32_t b) {
  auto& flat = reinterpret_cast<float(&)[kN / 2]>(d);
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    Wgmma<T, kN>::SS(flat, KMajorDescriptor<ATile>(a, kk), KMajorDescriptor<BTile>(b, kk), kk > 0);
  }
}

// The steps of a product into kCols output columns over a reduction of kK:
// issue(kk, c) for each k step kk (16 rows) and each chunk of kWgmmaChunk
// columns from c (the widest compiled wgmma, at most 128, that divides them).
// A chunk of an MN-major operand starts on a 64-column block of its swizzled
// tile (MnMajorDescriptor), so 192 columns go as three of 64, not two of 96.
template <int kCols>
constexpr int kWgmmaChunk = kCols <= 128 ? kCols : kCols % 128 == 0 ? 128 : 64;
template <int kK, int kCols, typename Issue>
__device__ __forceinline__ void ForWgmmaSteps(Issue&& issue) {
  constexpr int kChunk = kWgmmaChunk<kCols>;
  static_assert(kCols % kChunk == 0 && kChunk % 32 == 0, "output columns come in compiled wgmma widths");
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk)
#pragma unroll
    for (int c = 0; c < kCols; c += kChunk) issue(kk, c);
}

// How an operand's tile is stored: K-major (rows are M or N, columns the
// reduction index) or MN-major (rows are the reduction index).
enum class Major { kK, kMn };

// d = A·B over a reduction of kK: A is the 64 rows at `a` of a K-major ATile,
// or with kA = Major::kMn the 64 columns at `a` of an ATile that holds A
// transposed (e.g. dS from a tile of dSᵀ); B columns [n0, n0 + kCols) of the
// MN-major BTile at `b` (e.g. dQ = dS·K with K stored key by key).
// `accumulate`: d += A·B (otherwise the first k step overwrites d).
template <typename T, typename ATile, typename BTile, int kK, int kCols, Major kA = Major::kK>
__device__ __forceinline__ void ProductSSMn(float (&d)[kCols / 8][4], uint32_t a, uint32_t b, int n0,
                                            bool accumulate = false) {
  constexpr int kChunk = kWgmmaChunk<kCols>;
  ForWgmmaSteps<kK, kCols>([&](int kk, int c) {
    auto& acc = reinterpret_cast<float(&)[kChunk / 2]>(d[c / 8]);
    const uint32_t b_desc = MnMajorDescriptor<BTile>(b, kk, n0 + c);
    if constexpr (kA == Major::kMn) {
      Wgmma<T, kChunk>::SSMnAB(acc, MnMajorDescriptor<ATile>(a, kk, 0), b_desc, accumulate || kk > 0);
    } else {
      Wgmma<T, kChunk>::SSMn(acc, KMajorDescriptor<ATile>(a, kk), b_desc, accumulate || kk > 0);
    }
  });
}

// ------------------------------------------------------------ fragment stores
// Where a lane's pair of an accumulator row goes in a swizzled Tile (row
// `row`, columns 8 chunk + 2t and + 1, packed into 32 bits), and the store:
// how the epilogues stage O, dQ, dK and dV for a TMA store in the layout
// its map reads.
template <typename Tile>
__device__ __forceinline__ uint32_t PairOffset(int row, int chunk, int t) {
  return Tile::ChunkOffset(row, chunk) + 4 * t;
}
__device__ __forceinline__ void StoreShared32(uint32_t addr, uint32_t value) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(value) : "memory");
}
__device__ __forceinline__ uint32_t LoadShared32(uint32_t addr) {
  uint32_t value;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(value) : "r"(addr) : "memory");
  return value;
}

// Writes the transpose of a warp's 16 x 16 block held as an mma.sync A
// fragment (PackAFragment: rows r of the block in a[0], a[2] for r < 8 and
// a[1], a[3] for r >= 8; columns 0-7 in a[0], a[1], 8-15 in a[2], a[3]) into
// the K-major Tile at `tile`: block column c lands in tile row row0 + c,
// block rows as tile columns [col0, col0 + 16). One stmatrix.trans: lanes
// 8j..8j+7 name the eight tile rows of 8 x 8 matrix j.
template <typename Tile>
__device__ __forceinline__ void StoreTransposedFragment(uint32_t tile, const uint32_t (&a)[4], int row0, int col0,
                                                        int lane) {
  const int j = lane >> 3;
  const uint32_t addr = tile + Tile::ChunkOffset(row0 + (j >> 1) * 8 + (lane & 7), (col0 >> 3) + (j & 1));
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a[0]),
               "r"(a[1]), "r"(a[2]), "r"(a[3])
               : "memory");
}

// Writes a warp's 16 x 16 block held as an mma.sync A fragment as it is: block
// row r to tile row row0 + r, columns [col0, col0 + 16). One stmatrix: lanes
// 8j..8j+7 name the eight tile rows of 8 x 8 matrix j (a[j]).
template <typename Tile>
__device__ __forceinline__ void StoreFragment(uint32_t tile, const uint32_t (&a)[4], int row0, int col0, int lane) {
  const int j = lane >> 3;
  const uint32_t addr = tile + Tile::ChunkOffset(row0 + (j & 1) * 8 + (lane & 7), (col0 >> 3) + (j >> 1));
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a[0]), "r"(a[1]),
               "r"(a[2]), "r"(a[3])
               : "memory");
}

// d += A·B over a reduction of kK rows: A from registers (one packed fragment
// per 16 rows, PackAFragment), B columns [n0, n0 + kCols) of the MN-major
// BTile at `b`.
template <typename T, typename BTile, int kK, int kCols>
__device__ __forceinline__ void ProductRS(float (&d)[kCols / 8][4], const uint32_t (&a)[kK / 16][4], uint32_t b,
                                          int n0) {
  constexpr int kChunk = kWgmmaChunk<kCols>;
  ForWgmmaSteps<kK, kCols>([&](int kk, int c) {
    Wgmma<T, kChunk>::RS(reinterpret_cast<float(&)[kChunk / 2]>(d[c / 8]), a[kk],
                         MnMajorDescriptor<BTile>(b, kk, n0 + c), true);
  });
}

}  // namespace sm90
}  // namespace jaxflash
