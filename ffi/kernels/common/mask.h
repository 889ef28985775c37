// The mask policy, shared by the CPU and CUDA kernels.
//
// One object per batch element answers the two questions every kernel asks:
// which keys a block of query rows must visit (so fully masked tiles are
// skipped, never computed and discarded), and which elements inside a boundary
// tile are masked. The rule itself is written once, in MaskParams (params.h).
#pragma once

#include "jaxflash/params.h"

namespace jaxflash {

JAXFLASH_HD int MinInt(int a, int b) { return a < b ? a : b; }
JAXFLASH_HD int MaxInt(int a, int b) { return a > b ? a : b; }

struct MaskPolicy {
  static constexpr int kMaxOffset = 1 << 30;
  JAXFLASH_HD static int Saturate(int x) { return MaxInt(-kMaxOffset, MinInt(kMaxOffset, x)); }

  int q_valid;   // rows [0, q_valid) are real queries; the rest output zeros
  int kv_valid;  // keys [0, kv_valid) exist
  int offset;    // diagonal position of row 0
  int left;      // < 0: unbounded
  int right;     // < 0: unbounded

  // Sequence lengths are clamped to the padded sizes, so a bad length can
  // never send a kernel out of bounds.
  JAXFLASH_HD static MaskPolicy For(const MaskParams& mask, int q_len, int kv_len,
                                    const int32_t* q_lengths, const int32_t* kv_lengths,
                                    int batch_index) {
    MaskPolicy p;
    p.q_valid = q_lengths ? MaxInt(0, MinInt(q_len, q_lengths[batch_index])) : q_len;
    p.kv_valid = kv_lengths ? MaxInt(0, MinInt(kv_len, kv_lengths[batch_index])) : kv_len;
    // Saturated at +-2^30 (sequences are shorter), so that row + offset stays
    // inside int whatever the caller's offsets hold.
    const int extra = mask.diag_offsets ? Saturate(mask.diag_offsets[batch_index]) : 0;
    p.offset = Saturate((mask.bottom_right ? p.kv_valid - p.q_valid : 0) + extra);
    p.left = static_cast<int>(mask.window_left);
    p.right = static_cast<int>(mask.window_right);
    return p;
  }

  // The policy of batch element `batch` of a call (FwdParams or BwdParams).
  template <typename Params>
  JAXFLASH_HD static MaskPolicy ForBatch(const Params& p, int batch) {
    return For(p.mask, static_cast<int>(p.shape.q_len), static_cast<int>(p.shape.kv_len), p.q_lengths,
               p.kv_lengths, batch);
  }

  // Keys visible to one row: [KeyBegin(row), KeyEnd(row)). Both are
  // non-decreasing in row, so a block of rows [r0, r1) visits
  // [KeyBegin(r0), KeyEnd(r1 - 1)).
  JAXFLASH_HD int KeyBegin(int row) const {
    return left < 0 ? 0 : MaxInt(0, row + offset - left);
  }
  JAXFLASH_HD int KeyEnd(int row) const {
    return right < 0 ? kv_valid : MaxInt(0, MinInt(kv_valid, row + offset + right + 1));
  }

  // Rows that see one key: [RowBegin(col), RowEnd(col)), used by kernels that
  // walk query tiles for a fixed key tile (the dK/dV pass).
  JAXFLASH_HD int RowBegin(int col) const {
    return right < 0 ? 0 : MaxInt(0, MinInt(q_valid, col - offset - right));
  }
  JAXFLASH_HD int RowEnd(int col) const {
    if (col >= kv_valid) return 0;
    return left < 0 ? q_valid : MaxInt(0, MinInt(q_valid, col - offset + left + 1));
  }

  // Whether the row sees at least one key: rows that do not output zeros and
  // kEmptyRowLse whatever their inputs hold.
  JAXFLASH_HD bool HasKeys(int row) const { return row < q_valid && KeyBegin(row) < KeyEnd(row); }
  // Whether the row sees a key of [c0, c1) (a split's share of the keys).
  JAXFLASH_HD bool HasKeysIn(int row, int c0, int c1) const {
    return row < q_valid && MaxInt(KeyBegin(row), c0) < MinInt(KeyEnd(row), c1);
  }

  JAXFLASH_HD bool Visible(int row, int col) const {
    return row < q_valid && col >= KeyBegin(row) && col < KeyEnd(row);
  }
  // True when every (row, col) of the tile [r0, r1) x [c0, c1) is visible, so
  // the kernel can skip per-element masking. Assumes r0 < r1 and c0 < c1.
  JAXFLASH_HD bool TileIsFull(int r0, int r1, int c0, int c1) const {
    return r1 <= q_valid && c0 >= KeyBegin(r1 - 1) && c1 <= KeyEnd(r0);
  }
};

}  // namespace jaxflash
