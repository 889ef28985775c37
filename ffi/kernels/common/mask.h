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
  // This batch element's segment tables (params.h, SegmentField); null: no ids.
  const int32_t* q_seg = nullptr;
  const int32_t* kv_seg = nullptr;

  // Sequence lengths are clamped to the padded sizes, so a bad length can
  // never send a kernel out of bounds. kSegments false builds a policy that
  // ignores segment tables (a kernel whose registers cannot hold their code:
  // its launcher never gives it a call with segment ids: TileTakes, and
  // LaunchWsForward for the static walk of a tile with a dynamic one).
  template <bool kSegments = true>
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
    if (kSegments && mask.q_segments != nullptr) {
      p.q_seg = mask.q_segments + int64_t(batch_index) * q_len * kSegmentFields;
      p.kv_seg = mask.kv_segments + int64_t(batch_index) * kv_len * kSegmentFields;
    }
    return p;
  }

  // The policy of batch element `batch` of a call (FwdParams or BwdParams).
  template <bool kSegments = true, typename Params>
  JAXFLASH_HD static MaskPolicy ForBatch(const Params& p, int batch) {
    return For<kSegments>(p.mask, static_cast<int>(p.shape.q_len), static_cast<int>(p.shape.kv_len), p.q_lengths,
               p.kv_lengths, batch);
  }

  JAXFLASH_HD bool Segmented() const { return q_seg != nullptr; }
  JAXFLASH_HD int QuerySeg(int row, int field) const { return q_seg[row * kSegmentFields + field]; }
  JAXFLASH_HD int KeySeg(int col, int field) const { return kv_seg[col * kSegmentFields + field]; }

  // The window's keys of a row and rows of a key (no segment ids): both ends
  // non-decreasing.
  JAXFLASH_HD int WindowKeyBegin(int row) const {
    return left < 0 ? 0 : MaxInt(0, row + offset - left);
  }
  JAXFLASH_HD int WindowKeyEnd(int row) const {
    return right < 0 ? kv_valid : MaxInt(0, MinInt(kv_valid, row + offset + right + 1));
  }
  JAXFLASH_HD int WindowRowBegin(int col) const {
    return right < 0 ? 0 : MaxInt(0, MinInt(q_valid, col - offset - right));
  }
  JAXFLASH_HD int WindowRowEnd(int col) const {
    if (col >= kv_valid) return 0;
    return left < 0 ? q_valid : MaxInt(0, MinInt(q_valid, col - offset + left + 1));
  }

  // Keys one row sees lie in [KeyBegin(row), KeyEnd(row)): every one of them
  // unless segment ids leave gaps there (KeysExact(row) false: SameSegment
  // says which). Rows past q_valid and keys past kv_valid never read a
  // segment table (kernels ask about padding rows too).
  JAXFLASH_HD bool SegRow(int row) const { return q_seg != nullptr && row < q_valid; }
  JAXFLASH_HD bool SegCol(int col) const { return kv_seg != nullptr && col < kv_valid; }
  JAXFLASH_HD int KeyBegin(int row) const {
    return SegRow(row) ? QuerySeg(row, kSegBegin) : WindowKeyBegin(row);
  }
  JAXFLASH_HD int KeyEnd(int row) const {
    if (q_seg != nullptr) return row < q_valid ? QuerySeg(row, kSegEnd) : 0;
    return WindowKeyEnd(row);
  }
  JAXFLASH_HD bool KeysExact(int row) const { return !SegRow(row) || QuerySeg(row, kSegGapFree) != 0; }

  // Rows that see one key: [RowBegin(col), RowEnd(col)), exact unless
  // RowsExact(col) is false (as for keys).
  JAXFLASH_HD int RowBegin(int col) const {
    return SegCol(col) ? KeySeg(col, kSegBegin) : WindowRowBegin(col);
  }
  JAXFLASH_HD int RowEnd(int col) const {
    if (kv_seg != nullptr) return col < kv_valid ? KeySeg(col, kSegEnd) : 0;
    return WindowRowEnd(col);
  }
  JAXFLASH_HD bool RowsExact(int col) const { return !SegCol(col) || KeySeg(col, kSegGapFree) != 0; }

  // Whether row and col carry the same segment id (true without ids). Only
  // asked inside [KeyBegin(row), KeyEnd(row)), so both are real positions.
  JAXFLASH_HD bool SameSegment(int row, int col) const {
    return q_seg == nullptr || QuerySeg(row, kSegId) == KeySeg(col, kSegId);
  }

  // Keys a block of rows [r0, r_end) visits (r0 < r_end <= q_valid): every key
  // any of them sees lies in [BlockKeyBegin(r0), BlockKeyEnd(r_end - 1)).
  JAXFLASH_HD int BlockKeyBegin(int r0) const {
    return SegRow(r0) ? QuerySeg(r0, kSegEnvBegin) : WindowKeyBegin(r0);
  }
  JAXFLASH_HD int BlockKeyEnd(int last_row) const {
    if (q_seg != nullptr) return last_row < q_valid ? QuerySeg(last_row, kSegEnvEnd) : 0;
    return WindowKeyEnd(last_row);
  }
  // Rows a block of keys [c0, c_end) is seen by (c0 < c_end <= kv_valid).
  JAXFLASH_HD int BlockRowBegin(int c0) const {
    return SegCol(c0) ? KeySeg(c0, kSegEnvBegin) : WindowRowBegin(c0);
  }
  JAXFLASH_HD int BlockRowEnd(int last_col) const {
    if (kv_seg != nullptr) return last_col < kv_valid ? KeySeg(last_col, kSegEnvEnd) : 0;
    return WindowRowEnd(last_col);
  }

  // Keys every row of [r0, r_end) sees (r0 < r_end), as [begin, end); empty
  // when begin >= end. Without ids: from where the last row's keys start to
  // where the first row's end. With ids the rows must be one run of one id
  // whose first and last rows see keys, without gaps: those rows' keys are
  // then runs of the same id in windows that only move right, and every row
  // between sees at least their overlap. (A row that sees nothing has the
  // table's empty interval [kv_len, 0), which makes the block's empty as
  // first row or as last; [0, 0) once made a block full that was not.)
  struct Keys {
    int begin, end;
  };
  // kEager reads the five table fields at once (the rows are in range there):
  // one round trip of loads instead of up to four in turn, for a caller that
  // waits on the answer (the sm90 backward's step, its flag writer, the CPU
  // backward); the others keep the lazy order, whose fewer live registers
  // they need (eager, the sm80 D 32 forward spilled 28 bytes).
  template <bool kEager = false>
  JAXFLASH_HD Keys FullKeys(int r0, int r_end) const {
    if (r_end > q_valid) return {0, 0};
    if (q_seg != nullptr) {
      const int last = r_end - 1;
      if constexpr (kEager) {
        const int run_end = QuerySeg(r0, kSegRunEnd), first_gap_free = QuerySeg(r0, kSegGapFree);
        const int last_gap_free = QuerySeg(last, kSegGapFree);
        const Keys keys = {QuerySeg(last, kSegBegin), QuerySeg(r0, kSegEnd)};
        return run_end >= r_end && first_gap_free != 0 && last_gap_free != 0 ? keys : Keys{0, 0};
      }
      if (QuerySeg(r0, kSegRunEnd) < r_end || QuerySeg(r0, kSegGapFree) == 0 || QuerySeg(last, kSegGapFree) == 0) {
        return {0, 0};
      }
      return {QuerySeg(last, kSegBegin), QuerySeg(r0, kSegEnd)};
    }
    return {KeyBegin(r_end - 1), KeyEnd(r0)};
  }

  // Whether the row sees at least one key: rows that do not output zeros and
  // kEmptyRowLse whatever their inputs hold.
  JAXFLASH_HD bool HasKeys(int row) const { return row < q_valid && KeyBegin(row) < KeyEnd(row); }
  // Whether the row sees a key of [c0, c1) (a split's share of the keys).
  // Exact for rows whose keys have no gaps (split-KV calls with segment ids
  // are refused by the handlers: a split could hold only a gap).
  JAXFLASH_HD bool HasKeysIn(int row, int c0, int c1) const {
    return row < q_valid && MaxInt(KeyBegin(row), c0) < MinInt(KeyEnd(row), c1);
  }

  JAXFLASH_HD bool Visible(int row, int col) const {
    return row < q_valid && col >= KeyBegin(row) && col < KeyEnd(row) && SameSegment(row, col);
  }
  // True when every (row, col) of the tile [r0, r1) x [c0, c1) is visible, so
  // the kernel can skip per-element masking. Assumes r0 < r1 and c0 < c1.
  template <bool kEager = false>
  JAXFLASH_HD bool TileIsFull(int r0, int r1, int c0, int c1) const {
    const Keys full = FullKeys<kEager>(r0, r1);
    return c0 >= full.begin && c1 <= full.end;
  }
};

}  // namespace jaxflash
