// The dense bias and mask (params.h, DenseParams) in the tensor-core kernels.
//
// `DenseTile` is one (batch, query head)'s view of them: the bias, read in its
// own dtype and added in the kernels' log2 units, and the boolean mask, whose
// hidden pairs get a -inf score in the forward and P = 0 in the backward. A
// 16-bit bias whose rows are whole 16-byte copies is staged in shared memory
// tile by tile beside K (Stages, Stage); otherwise, and for the mask, each
// accumulator entry reads its own element from global memory (stride 0 on
// broadcast axes). Positions past the call's q_len / kv_len are never read
// (the mask policy hides them anyway).
//
// A CTA first summarises the mask over the tile it is about to compute
// (`Vote`, one barrier-vote in place of the loop's barrier): a tile the mask
// hides entirely is skipped, products and all; one it shows entirely skips the
// per-entry mask read. The forward also keeps, per accumulator row, whether it
// has seen a key the mask rule and the mask both admit (`Seen`), so a row the
// mask leaves without keys is empty (O = 0, kEmptyRowLse) as the contract
// says, and not the NaN of an all -inf softmax (which a bias of -inf gives).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "common/mask.h"
#include "common/mma.cuh"
#include "jaxflash/params.h"

namespace jaxflash {
namespace tc {

struct DenseTile {
  enum View { kHidden, kMixed, kShown };

  const void* bias = nullptr;     // element (row 0, key 0) of this (batch, head); null: no bias
  const uint8_t* mask = nullptr;  // the same for the mask; null: no mask
  DType bias_dtype = DType::kFloat32;
  int64_t bias_row = 0, bias_key = 0, mask_row = 0, mask_key = 0;  // strides, in elements
  int q_len = 0, kv_len = 0;
  View view = kShown;  // the current tile's, as the kernel's last Vote found it
  // The bias tile staged in shared memory (Stage) for the tile of rows from
  // staged_r0, keys from staged_c0, kStagePad elements past each row's kN;
  // null: read from global memory.
  const unsigned char* staged = nullptr;
  int staged_pitch = 0, staged_r0 = 0, staged_c0 = 0;
  static constexpr int kStagePad = 8;  // 16 bytes: rows g = 0..7 of a fragment in distinct banks

  // The terms of (batch, query head) of a call (FwdParams or BwdParams), with
  // the tile's `view`. Built per tile where it is used, like score_mod.cuh's
  // SoftCap::Of: the empty asm keeps the compiler from computing the pointers
  // once and holding a dozen registers across a kernel's loop for calls that
  // have no dense term. With kTakes false, none: a tile that takes no dense
  // term (launch_util.cuh's TileTakes) compiles as it would without one.
  template <bool kTakes = true, typename Params>
  __device__ __forceinline__ static DenseTile Of(const Params& p, int batch, int head, View view = kShown) {
    DenseTile t;
    if constexpr (!kTakes) return t;
    asm volatile("" : "+r"(head));
    const DenseParams& d = p.dense;
    t.view = view;
    t.q_len = static_cast<int>(p.shape.q_len);
    t.kv_len = static_cast<int>(p.shape.kv_len);
    if (d.bias.On()) {
      t.bias_dtype = d.bias.dtype;
      const int64_t at = d.bias.RowOffset(batch, head, 0);
      t.bias = static_cast<const char*>(d.bias.data) + at * (d.bias.dtype == DType::kFloat32 ? 4 : 2);
      t.bias_row = d.bias.row_stride;
      t.bias_key = d.bias.key_stride;
    }
    if (d.mask.On()) {
      t.mask = static_cast<const uint8_t*>(d.mask.data) + d.mask.RowOffset(batch, head, 0);
      t.mask_row = d.mask.row_stride;
      t.mask_key = d.mask.key_stride;
    }
    return t;
  }
  __device__ __forceinline__ bool On() const { return bias != nullptr || mask != nullptr; }

  // Whether a call's bias is staged tile by tile in shared memory by the
  // kernels that can (16-bit, keys contiguous, each row a whole number of
  // 16-byte copies): one coalesced copy per tile beside K, instead of an
  // entry's load from global memory where it is added, which cost the sm80
  // forward 5.7x its time on an H200 (docs/performance-log.md).
  template <typename Params>
  __host__ __device__ static bool Stages(const Params& p) {
    const DenseTerm& b = p.dense.bias;
    return b.On() && b.dtype != DType::kFloat32 && b.key_stride == 1 && b.row_stride != 0 &&
           b.row_stride % 8 == 0 && b.head_stride % 8 == 0 && b.batch_stride % 8 == 0 &&
           (reinterpret_cast<uintptr_t>(b.data) & 15) == 0;
  }
  // Shared memory for a staged bias tile of kRows x kCols.
  template <int kRows, int kCols>
  __host__ __device__ static constexpr size_t StageBytes() {
    return size_t(kRows) * (kCols + kStagePad) * 2;
  }
  // Starts the copy of the bias tile [r0, r0 + kRows) x [c0, c0 + kCols) into
  // `smem` (cp.async: the caller commits and waits); past the call, zeros.
  template <int kRows, int kCols, int kThreads>
  __device__ __forceinline__ void Stage(void* smem, int r0, int c0, int tid) const {
    LoadTile<kRows, kCols, kThreads>(static_cast<__half*>(smem), kCols + kStagePad,
                                     static_cast<const __half*>(bias) + r0 * bias_row + c0, bias_row, q_len - r0,
                                     kv_len - c0, tid);
  }
  // This view reading the bias from a tile Stage copied.
  __device__ __forceinline__ DenseTile Staged(const void* smem, int cols, int r0, int c0) const {
    DenseTile t = *this;
    t.staged = static_cast<const unsigned char*>(smem);
    t.staged_pitch = cols + kStagePad;
    t.staged_r0 = r0;
    t.staged_c0 = c0;
    return t;
  }

  // The bias of (query row, key) in log2 units; both must be real positions.
  __device__ __forceinline__ float Bias2(int row, int key) const {
    if (bias == nullptr) return 0.f;
    const int64_t i = row * bias_row + key * bias_key;
    float x;
    switch (bias_dtype) {
      case DType::kFloat16: x = __half2float(static_cast<const __half*>(bias)[i]); break;
      case DType::kBFloat16: x = __bfloat162float(static_cast<const __nv_bfloat16*>(bias)[i]); break;
      default: x = static_cast<const float*>(bias)[i];
    }
    return x * kLog2e;
  }
  __device__ __forceinline__ bool Shows(int row, int key) const {
    return mask == nullptr || mask[row * mask_row + key * mask_key] != 0;
  }

  // What the mask shows of query rows [r0, r1) x keys [c0, c1) (clipped to the
  // call; an empty tile shows nothing), kept as `view`. Every thread of the
  // CTA calls it: the votes are the barrier the caller's loop needs there anyway.
  __device__ __forceinline__ View Vote(int r0, int r1, int c0, int c1, int tid, int threads) {
    int any = 0, all = 1;
    if (mask != nullptr) {
      r1 = MinInt(r1, q_len);
      c1 = MinInt(c1, kv_len);
      if (mask_row == 0) r1 = MinInt(r1, r0 + 1);  // broadcast rows: one of them says it all
      if (mask_key == 0) c1 = MinInt(c1, c0 + 1);
      const int rows = r1 - r0, cols = c1 - c0;
      if (rows <= 0 || cols <= 0) {
        all = 0;
      } else {
        // 16 bytes a load where the rows allow it (a bool is a 0 / 1 byte), else
        // bytes; each thread walks (row, chunk) slots by a fixed step, no
        // division per slot (one per tile cost as much as the products).
        const uint8_t* base = mask + r0 * mask_row + c0 * mask_key;
        const bool wide = mask_key == 1 && cols % 16 == 0 && mask_row % 16 == 0 &&
                          (reinterpret_cast<uintptr_t>(base) & 15) == 0;
        const int width = wide ? 16 : 1, chunks = cols / width;
        int r = tid / chunks, w = tid - r * chunks;
        const int dr = threads / chunks, dw = threads - dr * chunks;
        while (r < rows) {
          const uint8_t* at = base + int64_t(r) * mask_row + int64_t(w) * width * mask_key;
          if (wide) {
            const uint4 x = *reinterpret_cast<const uint4*>(at);
            any |= (x.x | x.y | x.z | x.w) != 0u;
            all &= (x.x & x.y & x.z & x.w) == 0x01010101u;
          } else {
            const int shown = *at != 0;
            any |= shown;
            all &= shown;
          }
          w += dw;
          r += dr;
          if (w >= chunks) {
            w -= chunks;
            ++r;
          }
        }
      }
    }
    any = __syncthreads_or(any || mask == nullptr);
    all = __syncthreads_and(all);
    view = !any ? kHidden : all ? kShown : kMixed;
    return view;
  }

  // The barrier at the top of a kernel's tile loop: with a dense mask, its
  // Vote over the tile (the view the kernel then builds its DenseTile with;
  // kHidden: skip the tile), else a plain __syncthreads(). kTakes as Of's.
  template <bool kTakes = true, typename Params>
  __device__ __forceinline__ static View TileBarrier(const Params& p, int batch, int head, int r0, int r1, int c0,
                                                     int c1, int tid, int threads) {
    if (kTakes && p.dense.mask.On()) return Of<kTakes>(p, batch, head).Vote(r0, r1, c0, c1, tid, threads);
    __syncthreads();
    return kShown;
  }

  // Calls f(entry, query row, key) for accumulator row `half`'s entries that
  // are real positions: `row` is the row's position, its columns the other
  // side's col0 + nt * 8 + j (col0 = the tile's first + 2t); kRowsAreQueries
  // says whether rows are query rows (keys the columns) or keys.
  template <bool kRowsAreQueries, int kT, typename F>
  __device__ __forceinline__ void ForRealEntries(float (&s)[kT][4], int half, int row, int col0, F&& f) const {
#pragma unroll
    for (int nt = 0; nt < kT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = col0 + nt * 8 + j;
        const int q = kRowsAreQueries ? row : col, k = kRowsAreQueries ? col : row;
        if (q < q_len && k < kv_len) f(s[nt][2 * half + j], q, k);
      }
  }
  // Adds the bias to one accumulator row of a score tile in log2 units.
  template <bool kRowsAreQueries, int kT>
  __device__ __forceinline__ void AddBias(float (&s)[kT][4], int half, int row, int col0) const {
    if (bias == nullptr) return;
    if (staged != nullptr) {
      AddStagedBias<kRowsAreQueries>(s, half, row, col0);
      return;
    }
    ForRealEntries<kRowsAreQueries>(s, half, row, col0, [&](float& x, int q, int k) { x += Bias2(q, k); });
  }
  // Sets the entries the mask hides to `hidden` (-inf for a score, 0 for a
  // probability), on a tile the vote found mixed (nothing otherwise).
  template <bool kRowsAreQueries, int kT>
  __device__ __forceinline__ void Hide(float (&s)[kT][4], int half, int row, int col0, float hidden) const {
    if (view != kMixed) return;
    ForRealEntries<kRowsAreQueries>(s, half, row, col0, [&](float& x, int q, int k) {
      if (!Shows(q, k)) x = hidden;
    });
  }

  // AddBias from the staged tile: query-major, a lane's two keys of a row are
  // one 4-byte word of shared memory; key-major, its two queries of a key are
  // two rows apart.
  template <bool kRowsAreQueries, int kT>
  __device__ __forceinline__ void AddStagedBias(float (&s)[kT][4], int half, int row, int col0) const {
    const bool fp16 = bias_dtype == DType::kFloat16;
    if constexpr (kRowsAreQueries) {
      const unsigned char* at = staged + 2 * ((row - staged_r0) * staged_pitch + (col0 - staged_c0));
#pragma unroll
      for (int nt = 0; nt < kT; ++nt) {
        const float2 x = PairLog2Units(*reinterpret_cast<const uint32_t*>(at + 16 * nt), fp16);
        s[nt][2 * half] += x.x;
        s[nt][2 * half + 1] += x.y;
      }
    } else {
      const uint16_t* at = reinterpret_cast<const uint16_t*>(staged) + (col0 - staged_r0) * staged_pitch +
                           (row - staged_c0);
#pragma unroll
      for (int nt = 0; nt < kT; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) s[nt][2 * half + j] += Log2Units(at[(nt * 8 + j) * staged_pitch], fp16);
    }
  }
  // A staged 16-bit bias entry (float16 where `fp16`, else bfloat16) in the
  // scores' log2 units, and a 32-bit word of two (the lower one in x; also
  // the Hopper forward's, sm90 AddStagedBias). A bfloat16 is a float's top
  // half: a shift or a mask, where a conversion of each half took two.
  __device__ __forceinline__ static float Log2Units(uint16_t h, bool fp16) {
    return (fp16 ? __half2float(__ushort_as_half(h)) : __bfloat162float(__ushort_as_bfloat16(h))) * kLog2e;
  }
  __device__ __forceinline__ static float2 PairLog2Units(uint32_t w, bool fp16) {
    const float2 x = Pair(w, fp16);
    return make_float2(x.x * kLog2e, x.y * kLog2e);
  }
  __device__ __forceinline__ static float2 Pair(uint32_t w, bool fp16) {  // (as they are)
    const float lo = fp16 ? __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xffffu)))
                          : __uint_as_float(w << 16);
    const float hi = fp16 ? __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)))
                          : __uint_as_float(w & 0xffff0000u);
    return make_float2(lo, hi);
  }

  // Both on a query-major score tile of kMT m16 row slabs (the forward's):
  // this warp's rows from `row0`, key tile from c0.
  template <int kMT, int kNT>
  __device__ __forceinline__ void ApplyRows(float (&s)[kMT][kNT][4], int row0, int c0, int lane) const {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = row0 + mt * 16 + g + half * 8;
        AddBias<true>(s[mt], half, row, c0 + 2 * t);
        Hide<true>(s[mt], half, row, c0 + 2 * t, -INFINITY);
      }
  }

  // The forward's per-row record of a visible key: bit mt * 2 + half of the
  // lane's rows is set once the row meets a pair the mask rule (`pol`) and the
  // mask both admit. Only the mask can leave a row without keys the rule
  // gives it, so without a mask every row counts as seen.
  template <int kMT, int kNT>
  __device__ __forceinline__ void Seen(unsigned& seen, const MaskPolicy& pol, int row0, int c0, int lane) const {
    if (mask == nullptr || view == kHidden) return;
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int bit = mt * 2 + half, row = row0 + mt * 16 + g + half * 8;
        if (seen >> bit & 1u) continue;
        bool any = false;
        for (int nt = 0; nt < kNT && !any; ++nt)
          for (int j = 0; j < 2; ++j) {
            const int col = c0 + 2 * t + nt * 8 + j;
            any |= col < kv_len && pol.Visible(row, col) && (view == kShown || Shows(row, col));
          }
        if (any) seen |= 1u << bit;
      }
  }
  // The rows of a quad share what any of its lanes saw; called by every lane
  // of the warp, before any row-dependent branch (exact_rows.cuh: a warp
  // collective after one hung the H100).
  __device__ __forceinline__ unsigned QuadSeen(unsigned seen) const {
    seen |= __shfl_xor_sync(0xffffffffu, seen, 1);
    seen |= __shfl_xor_sync(0xffffffffu, seen, 2);
    return mask == nullptr ? ~0u : seen;
  }
};

}  // namespace tc
}  // namespace jaxflash
