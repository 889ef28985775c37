// ALiBi (params.h, FwdParams::alibi), shared by the CPU and CUDA kernels: the
// score of query row i and key j gains -slope * |i + offset - j|, where
// i + offset is the row's diagonal under the mask policy (the causal
// alignment, the lengths and ring attention's diagonal offsets), so a causal
// row's own position is at distance 0. It is added after the soft-cap and
// before masking, in the log2 units the kernels work in, and never changes
// which pairs are visible; the backward needs it only to recompute P.
#pragma once

#include "common/mask.h"

namespace jaxflash {

struct Alibi {
  float neg_slope2 = 0.f;  // -slope * log2(e) of one (batch, query head); 0: no bias

  JAXFLASH_HD static Alibi Of(const float* slopes, int64_t batch, int64_t head, int64_t heads) {
    Alibi a;
    if (slopes != nullptr) a.neg_slope2 = -slopes[batch * heads + head] * 1.4426950408889634f;
    return a;
  }
  // A NaN slope is on (and makes every score of the head NaN).
  JAXFLASH_HD bool On() const { return neg_slope2 != 0.f; }

  // The key position at distance 0 from `row`, as a float: distances are
  // differences of floats, exact below 2^24.
  JAXFLASH_HD static float Diagonal(const MaskPolicy& pol, int row) { return static_cast<float>(row + pol.offset); }
  JAXFLASH_HD float Bias(float diagonal, float key) const {
    const float d = diagonal - key;
    return neg_slope2 * (d < 0.f ? -d : d);
  }
};

}  // namespace jaxflash
