// The per-element segment test of the tensor-core kernels' boundary tiles.
//
// The mask policy (mask.h) gives each query row one interval of keys, and
// each key one interval of rows; with segment ids that interval is exact
// unless the ids leave gaps in it (ids that are not sorted within a row, or a
// segment that reappears). Only then do the ids themselves need comparing,
// which this does for one accumulator row of a thread: the rare path, after
// the interval test, on tiles the policy did not find full.
#pragma once

#include "common/mask.h"

namespace jaxflash {
namespace tc {

// Accumulator row `half` of a thread (lane quad index t) belongs to position
// `pos` (a query row when kRowIsQuery, else a key); its columns are the other
// side's positions other0 + nt * 8 + 2t + j. Entries whose segment id differs
// from pos's are set to `hidden`. Nothing happens without segment ids or when
// pos's interval has no gap.
template <bool kRowIsQuery, int kT>
__device__ __forceinline__ void HideOtherSegments(float (&s)[kT][4], int half, const MaskPolicy& pol, int pos,
                                                  int other0, int t, float hidden) {
  if (!pol.Segmented() || (kRowIsQuery ? pol.KeysExact(pos) : pol.RowsExact(pos))) return;
  const int id = kRowIsQuery ? pol.QuerySeg(pos, kSegId) : pol.KeySeg(pos, kSegId);
  const int valid = kRowIsQuery ? pol.kv_valid : pol.q_valid;
#pragma unroll  // (s stays in registers only with constant indices)
  for (int nt = 0; nt < kT; ++nt) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int other = other0 + nt * 8 + 2 * t + j;
      // Positions past the other side's length are outside pos's interval, so
      // already hidden; their table rows may not exist.
      if (other >= valid) continue;
      const int other_id = kRowIsQuery ? pol.KeySeg(other, kSegId) : pol.QuerySeg(other, kSegId);
      if (other_id != id) s[nt][2 * half + j] = hidden;
    }
  }
}

}  // namespace tc
}  // namespace jaxflash
