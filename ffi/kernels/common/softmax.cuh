// Online softmax over K/V tiles for rows held in mma.sync accumulators.
//
// A warp owns kMT m16 row tiles; each lane owns two rows per tile (g and
// g + 8, see mma.cuh), so a lane tracks 2 * kMT rows. Scores arrive already
// multiplied by scale * log2(e) ("log2 units") with masked entries at -inf,
// so every exponent is a single exp2 and the scale sign needs no special case.
//
// Per row we keep the running max m (log2 units) and the lane-partial running
// sum l of exp2(s - m); the four lanes of a quad hold disjoint columns of the
// same row, so l is reduced across the quad only once, in Finalize.
#pragma once

#include <cmath>

#include "common/mma.cuh"

namespace jaxflash {
namespace tc {

template <int kMT>
struct OnlineSoftmax {
  static constexpr int kRows = 2 * kMT;
  float m[kRows];
  float l[kRows];

  __device__ __forceinline__ void Init() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      m[r] = -INFINITY;
      l[r] = 0.f;
    }
  }

  // Folds one tile of scores into the state: turns s into the unnormalised
  // probabilities exp2(scale * s - m_new) and returns, per row, the factor
  // alpha = exp2(m_old - m_new) by which output accumulated so far must be
  // rescaled (Rescale). Kept apart so a kernel can overlap the score math
  // with a product still accumulating into o. `scale` (> 0) lets a kernel
  // pass raw scores and fold the scale into the exponent's FFMA; the row max
  // is taken on the raw scores, which a positive scale does not reorder.
  //
  // With kLazy the reference a row's exponents are taken against lags: it is
  // the running max m as it stood when the row last outgrew it by more than
  // kLazyMargin (log2 units). Until then the row's probabilities stay below
  // 2^kLazyMargin (bf16 and fp16 hold them as precisely as values below 1),
  // its sum and output keep accumulating against the same reference, and
  // Totals normalises them as with a current max. Returns whether the
  // reference of either of the thread's rows moved (always, without kLazy):
  // when neither did, alpha is 1 and the caller may skip Rescale, a multiply
  // per output element per key tile. Each row decides from its own scores
  // alone (its quad agrees through QuadMax), so no row's rounding depends on
  // another's values, padding rows' included; a warp runs the multiplies when
  // any of its lanes needs them. A NaN or +inf score always moves it.
  //
  // `row_offset` (raw units, one for each of this thread's rows, which may
  // differ between the lanes of a quad; null: none) is added to every score of
  // the thread's row as the max and the exponents are taken, not to the
  // scores themselves: a bias whose per-row part rides in the exponent's FFMA
  // addend (AddAlibiSplit in fwd_blocks.cuh).
  static constexpr float kLazyMargin = 8.f;
  template <bool kLazy = false, int kNT>
  __device__ __forceinline__ bool Scores(float (&s)[kMT][kNT][4], float (&alpha)[kRows], float scale = 1.f,
                                         const float* row_offset = nullptr) {
    bool moved = false;
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = mt * 2 + half;
        float mx = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          mx = MaxNaN(mx, MaxNaN(s[mt][nt][2 * half], s[mt][nt][2 * half + 1]));
        }
        const float offset = row_offset != nullptr ? row_offset[r] * scale : 0.f;
        // (The offset may differ between the lanes of a row's quad, so it goes
        // in before their max is taken.)
        mx = MaxNaN(m[r], row_offset != nullptr ? QuadMax(fmaf(mx, scale, offset)) : QuadMax(mx) * scale);
        const bool move = !kLazy || !(mx <= m[r] + kLazyMargin);
        moved |= move;
        const float m_new = move ? mx : m[r];
        // A row that has seen only masked (or -inf) scores keeps m = -inf;
        // subtracting 0 instead keeps exp2(-inf - ...) at 0 rather than NaN.
        // A NaN score makes m, and so the whole row, NaN.
        const float ref = m_new == -INFINITY ? 0.f : m_new;
        alpha[r] = move ? Exp2(m[r] - ref) : 1.f;
        m[r] = m_new;
        const float addend = row_offset != nullptr ? offset - ref : -ref;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNT; ++nt) {
          const float x0 = fmaf(s[mt][nt][2 * half], scale, addend);
          const float x1 = fmaf(s[mt][nt][2 * half + 1], scale, addend);
          const float p0 = Exp2(x0);
          const float p1 = Exp2(x1);
          s[mt][nt][2 * half] = p0;
          s[mt][nt][2 * half + 1] = p1;
          sum += p0 + p1;
        }
        l[r] = l[r] * alpha[r] + sum;
      }
    }
    return moved;
  }

  template <int kDT>
  __device__ __forceinline__ static void Rescale(float (&o)[kMT][kDT][4], const float (&alpha)[kRows]) {
#pragma unroll
    for (int mt = 0; mt < kMT; ++mt)
#pragma unroll
      for (int dt = 0; dt < kDT; ++dt)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[mt][dt][i] *= alpha[mt * 2 + i / 2];
  }

  // Scores, then Rescale of the output accumulator o.
  template <int kNT, int kDT>
  __device__ __forceinline__ void Update(float (&s)[kMT][kNT][4], float (&o)[kMT][kDT][4]) {
    float alpha[kRows];
    Scores(s, alpha);
    Rescale(o, alpha);
  }

  // The row totals: per row the factor 1 / sum that normalises the output
  // and the natural-log LSE, as a dense softmax over the scores seen would
  // give: a +inf or NaN score leaves the row and its LSE NaN, and a row whose
  // scores were all -inf (or masked) has sum 0, so 0 / 0 = NaN and LSE -inf.
  // Which rows see no key at all is the mask's business, not the sum's: the
  // caller zeroes those (StoreOutput). Apart from Finalize so that a kernel
  // can take them while its last P·V still accumulates into o.
  __device__ __forceinline__ void Totals(float (&inv)[kRows], float (&lse)[kRows]) const {
    constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float sum = QuadSum(l[r]);
      inv[r] = 1.f / sum;
      lse[r] = (m[r] + __log2f(sum)) * kLn2;
    }
  }

  // Totals, then o normalised by the row sums.
  template <int kDT>
  __device__ __forceinline__ void Finalize(float (&o)[kMT][kDT][4], float (&lse)[kRows]) const {
    float inv[kRows];
    Totals(inv, lse);
    Rescale(o, inv);
  }
};

}  // namespace tc
}  // namespace jaxflash
