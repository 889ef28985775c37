// The dense bias and mask (params.h, DenseParams) in the tensor-core kernels.
//
// `DenseTile` is one (batch, query head)'s view of them: the bias, read in its
// own dtype and added in the kernels' log2 units, and the boolean mask, whose
// hidden pairs get a -inf score (P = 0 exactly). Each accumulator entry reads
// its own element straight from global memory (stride 0 on broadcast axes);
// positions past the call's q_len / kv_len are never read (the mask policy
// hides them anyway).
//
// A CTA first summarises the mask over the tile it is about to compute
// (`View`, one barrier-vote in place of the loop's barrier): a tile the mask
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
  __device__ __forceinline__ bool HasMask() const { return mask != nullptr; }

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
      const int cols = c1 - c0, n = cols > 0 && r1 > r0 ? (r1 - r0) * cols : 0;
      for (int i = tid; i < n; i += threads) {
        const int r = r0 + i / cols, c = c0 + i % cols;
        const int shown = mask[r * mask_row + c * mask_key] != 0;
        any |= shown;
        all &= shown;
      }
      if (n == 0) all = 0;
    }
    any = __syncthreads_or(any || mask == nullptr);
    all = __syncthreads_and(all);
    view = !any ? kHidden : all ? kShown : kMixed;
    return view;
  }

  // Adds the bias to one accumulator row of a score tile in log2 units.
  // `row` is accumulator row `half`'s position, its columns the other side's
  // col0 + nt * 8 + j (col0 = the tile's first + 2t); kRowsAreQueries says
  // whether rows are query rows (keys the columns) or keys.
  template <bool kRowsAreQueries, int kT>
  __device__ __forceinline__ void AddBias(float (&s)[kT][4], int half, int row, int col0) const {
    if (bias == nullptr) return;
#pragma unroll
    for (int nt = 0; nt < kT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = col0 + nt * 8 + j;
        const int q = kRowsAreQueries ? row : col, k = kRowsAreQueries ? col : row;
        if (q < q_len && k < kv_len) s[nt][2 * half + j] += Bias2(q, k);
      }
  }
  // Sets the entries the mask hides to `hidden` (-inf for a score, 0 for a
  // probability), on a tile the vote found mixed (nothing otherwise).
  template <bool kRowsAreQueries, int kT>
  __device__ __forceinline__ void Hide(float (&s)[kT][4], int half, int row, int col0, float hidden) const {
    if (view != kMixed) return;
#pragma unroll
    for (int nt = 0; nt < kT; ++nt)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int col = col0 + nt * 8 + j;
        const int q = kRowsAreQueries ? row : col, k = kRowsAreQueries ? col : row;
        if (q < q_len && k < kv_len && !Shows(q, k)) s[nt][2 * half + j] = hidden;
      }
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
        AddBias<true>(s[mt], half, row0 + mt * 16 + g + half * 8, c0 + 2 * t);
        Hide<true>(s[mt], half, row0 + mt * 16 + g + half * 8, c0 + 2 * t, -INFINITY);
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
