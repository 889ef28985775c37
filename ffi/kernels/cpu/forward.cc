// CPU forward: tiled online softmax, fp32 accumulation.
//
// One work item is (batch, K/V head, tile of kRowsPerTile packed rows, split).
// Packed rows stack the query heads of a GQA group (common/decode.h), so a
// K/V tile is loaded once for all the heads that read it. The item streams
// its split's share of the K/V tiles the mask policy says the rows can see,
// keeps a running max and sum per row in base 2 (log2(e) folded into the
// scale), and writes O and the LSE once; with several splits it writes the
// split's partials instead and a second pass merges them (MergeRow). K/V rows
// are found through PagedKv, so a paged cache is read in place. Memory beyond
// inputs and outputs: a few tiles per worker.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/alibi.h"
#include "common/decode.h"
#include "common/mask.h"
#include "cpu/dense.h"
#include "cpu/tile.h"
#include "jaxflash/launch.h"

namespace jaxflash {
namespace {

using namespace cpu;

struct ForwardTile {
  float q[kRowsPerTile * kMaxHeadDim];        // scaled by scale * log2(e)
  float kt[kMaxHeadDim * kKeysPerTile];       // K tile transposed
  float v[kKeysPerTile * kMaxHeadDim];
  float s[kRowsPerTile * kKeysPerTile];       // base-2 logits, then probabilities
  float acc[kRowsPerTile * kMaxHeadDim];      // unnormalised output
  float row_max[kRowsPerTile];
  float row_sum[kRowsPerTile];
  bool dense_seen[kRowsPerTile];              // the row saw a key the dense mask shows
};

// Loads keys [c0, c0 + cols) of one K/V head: K transposed into kt, V (rows
// of the value's head dim) into v. Dense K/V is one run of rows; paged K/V one
// run per page touched.
JAXFLASH_CPU_INLINE void LoadKeys(const FwdParams& p, int64_t b, int64_t kv_head, int c0, int cols,
                                  ForwardTile& t) {
  const AttentionShape& sh = p.shape;
  const int dim = static_cast<int>(sh.head_dim), vdim = static_cast<int>(sh.v_dim());
  for (int c = 0; c < cols;) {
    const int key = c0 + c;
    const int run = p.paged.table == nullptr
                        ? cols - c
                        : std::min<int>(cols - c, static_cast<int>(p.paged.page_size - key % p.paged.page_size));
    const int64_t row = p.paged.Row(b, sh.kv_len, key);
    LoadRowsTransposed(p.k, row * sh.kv_row_stride() + kv_head * dim, sh.kv_row_stride(), run, dim, p.dtype,
                       kKeysPerTile, t.kt + c);
    LoadRows(p.v, row * sh.v_row_stride() + kv_head * vdim, sh.v_row_stride(), run, vdim, p.dtype, 1.f,
             t.v + c * vdim);
    c += run;
  }
}

JAXFLASH_CPU_CLONES void ForwardItem(const FwdParams& p, int64_t item, ForwardTile& t) {
  const AttentionShape& sh = p.shape;
  const int dim = static_cast<int>(sh.head_dim), vdim = static_cast<int>(sh.v_dim());
  const PackedRows packed = PackedRows::For(sh);
  const int64_t row_tiles = (packed.total + kRowsPerTile - 1) / kRowsPerTile;
  const int split = static_cast<int>(item % p.num_splits);
  const int64_t tile_item = item / p.num_splits;
  const int64_t b = tile_item / (sh.kv_heads * row_tiles);
  const int64_t kv_head = (tile_item / row_tiles) % sh.kv_heads;
  const int r0 = static_cast<int>((tile_item % row_tiles) * kRowsPerTile);
  const int rows = std::min(kRowsPerTile, packed.total - r0);

  const MaskPolicy mask = MaskPolicy::For(p.mask, static_cast<int>(sh.q_len),
                                          static_cast<int>(sh.kv_len), p.q_lengths,
                                          p.kv_lengths, static_cast<int>(b));

  std::fill(t.acc, t.acc + rows * vdim, 0.f);
  std::fill(t.row_max, t.row_max + rows, kNegInf);
  std::fill(t.row_sum, t.row_sum + rows, 0.f);
  std::fill(t.dense_seen, t.dense_seen + rows, false);
  const DenseRows dense{p.dense, b};
  const auto head_row = [&](int r) {
    return std::pair<int64_t, int>(packed.Head(static_cast<int>(kv_head), r0 + r), packed.QueryRow(r0 + r));
  };

  // Packed rows of padding queries (past q_lengths) come last in the tile.
  const int valid_rows = std::min(rows, std::max(0, mask.q_valid * packed.group - r0));
  const int key_begin = valid_rows > 0 ? mask.BlockKeyBegin(packed.QueryRow(r0)) : 0;
  const int key_end = valid_rows > 0 ? mask.BlockKeyEnd(packed.QueryRow(r0 + valid_rows - 1)) : 0;
  // This split's key tiles, counted from key_begin (one split: all of them).
  const Span span = SplitSpan(0, (std::max(0, key_end - key_begin) + kKeysPerTile - 1) / kKeysPerTile, split,
                              p.num_splits);
  const int split_begin = key_begin + span.begin * kKeysPerTile;
  const int split_end = std::min(key_end, key_begin + span.end * kKeysPerTile);
  if (split_begin < split_end) {
    for (int r = 0; r < rows; ++r) {
      LoadRows(p.q, packed.Offset(sh, static_cast<int>(b), static_cast<int>(kv_head), r0 + r), 0, 1, dim,
               p.dtype, p.scale * kLog2e, t.q + r * dim);
    }
  }
  for (int c0 = split_begin; c0 < split_end; c0 += kKeysPerTile) {
    const int cols = std::min(kKeysPerTile, split_end - c0);
    const auto view = dense.Tile(valid_rows, head_row, c0, cols);
    if (view == DenseRows::View::kHidden) continue;
    LoadKeys(p, b, kv_head, c0, cols, t);
    RowsTimesTransposed(t.q, valid_rows, dim, t.kt, kKeysPerTile, cols, t.s, kKeysPerTile);
    if (p.softcap > 0) {
      for (int r = 0; r < valid_rows; ++r) SoftCap{p.softcap}.Apply(t.s + r * kKeysPerTile, cols);
    }
    if (p.alibi != nullptr) {  // each packed row has its own head's slope
      for (int r = 0; r < valid_rows; ++r) {
        const Alibi alibi = Alibi::Of(p.alibi, b, packed.Head(static_cast<int>(kv_head), r0 + r), sh.q_heads);
        const float diagonal = Alibi::Diagonal(mask, packed.QueryRow(r0 + r));
        float* s = t.s + r * kKeysPerTile;
        for (int c = 0; c < cols; ++c) s[c] += alibi.Bias(diagonal, static_cast<float>(c0 + c));
      }
    }
    if (p.dense.bias.On()) {
      for (int r = 0; r < valid_rows; ++r) {
        const auto [head, row] = head_row(r);
        dense.AddBias(head, row, c0, cols, t.s + r * kKeysPerTile);
      }
    }

    const bool full = mask.TileIsFull(packed.QueryRow(r0), packed.QueryRow(r0 + valid_rows - 1) + 1, c0, c0 + cols);
    const bool mixed = view == DenseRows::View::kMixed;
    // Which keys of the tile row r sees: the mask rule's span, with the ids and the
    // dense mask asked where they may leave gaps in it.
    const auto cols_of = [&](int r) {
      VisibleSpan span = VisibleColsOf(mask, packed.QueryRow(r0 + r), c0, cols);
      span.exact &= !mixed;
      return span;
    };
    const auto sees = [&](int r, int c) {
      const auto [head, row] = head_row(r);
      return mask.SameSegment(row, c0 + c) && (!mixed || dense.Shows(head, row, c0 + c));
    };
    for (int r = 0; r < valid_rows; ++r) {
      float* s = t.s + r * kKeysPerTile;
      if (!full) HideUnseen(mask, packed.QueryRow(r0 + r), c0, cols, s);
      if (mixed) dense.Hide(head_row(r).first, head_row(r).second, c0, cols, s);
      if (p.dense.mask.On() && !t.dense_seen[r]) {
        const VisibleSpan span = cols_of(r);
        for (int c = span.begin; c < span.end && !t.dense_seen[r]; ++c) t.dense_seen[r] = span.exact || sees(r, c);
      }
      float tile_max = kNegInf;
      for (int c = 0; c < cols; ++c) tile_max = MaxNaN(tile_max, s[c]);
      const float new_max = MaxNaN(t.row_max[r], tile_max);
      if (new_max == kNegInf) {  // nothing visible to this row yet
        std::fill(s, s + cols, 0.f);
        continue;
      }
      const float rescale = Exp2(t.row_max[r] - new_max);
      for (int c = 0; c < cols; ++c) s[c] = Exp2(s[c] - new_max);  // vectorised
      float sum = 0.f;
      for (int c = 0; c < cols; ++c) sum += s[c];
      t.row_max[r] = new_max;
      t.row_sum[r] = t.row_sum[r] * rescale + sum;
      float* acc = t.acc + r * vdim;
      for (int d = 0; d < vdim; ++d) acc[d] *= rescale;
    }
    // O += P V; in a partly visible tile each row multiplies only the keys it
    // sees, so a NaN or Inf in the value of a masked key never reaches it.
    // With a dense mask every hidden pair has P = 0 exactly, so finite values let the
    // whole tile's product run.
    const bool plain = (full && !mixed) || (p.dense.mask.On() && Finite(t.v, cols, vdim, vdim));
    AccumulateVisible(plain, t.s, kKeysPerTile, valid_rows, cols, t.v, vdim, vdim, t.acc, vdim, cols_of, sees);
  }

  // The rows' results, by the rules of params.h and common/decode.h: one
  // split writes O and the natural LSE, several write their partials.
  const bool partial = p.num_splits > 1;
  for (int r = 0; r < rows; ++r) {
    float* acc = t.acc + r * vdim;
    const int pr = r0 + r;
    const bool seen = mask.HasKeysIn(packed.QueryRow(pr), split_begin, split_end) &&
                      (!p.dense.mask.On() || t.dense_seen[r]);
    float lse2 = kEmptyRowLse;
    if (!seen) {
      std::fill(acc, acc + vdim, 0.f);
    } else {
      // As in a dense softmax: a row whose visible scores are all -inf has sum
      // 0 and gets 0 / 0 = NaN (a split keeps its acc and LSE -inf for the
      // merge); a +inf or NaN score makes the sum, and so the whole row and
      // its LSE, NaN.
      const float sum = partial && t.row_sum[r] == 0.f ? 1.f : t.row_sum[r];
      const float inv = 1.f / sum;
      for (int d = 0; d < vdim; ++d) acc[d] *= inv;
      lse2 = t.row_max[r] + std::log2(sum);
    }
    if (!partial) {
      p.lse[packed.LseIndex(sh, static_cast<int>(b), static_cast<int>(kv_head), pr)] =
          seen ? lse2 * kLn2 : kEmptyRowLse;
      StoreRows(p.o, packed.OutOffset(sh, static_cast<int>(b), static_cast<int>(kv_head), pr), 0, 1, vdim,
                p.dtype, acc);
    } else {
      const int64_t row = packed.PartialRow(sh, p.num_splits, static_cast<int>(b), split,
                                            static_cast<int>(kv_head), pr);
      p.lse_partial[row] = lse2;
      std::copy(acc, acc + vdim, p.o_partial + row * vdim);
    }
  }
}

// Output row `row` ((batch, query row, head) in O's order) from the splits'
// partials, by the rule in common/decode.h.
JAXFLASH_CPU_CLONES void MergeRow(const FwdParams& p, int64_t row, float* out) {
  const AttentionShape& sh = p.shape;
  const int dim = static_cast<int>(sh.v_dim());  // O's
  const int64_t per_batch = sh.q_len * sh.q_heads;
  const int64_t b = row / per_batch, within = row % per_batch;
  const int64_t first = b * p.num_splits * per_batch + within;  // split s: first + s * per_batch
  const auto lse = [&](int s) { return p.lse_partial[first + s * per_batch]; };
  const SplitMerge merge = SplitMerge::Of(p.num_splits, lse);
  float sum = 0.f;
  std::fill(out, out + dim, 0.f);
  for (int s = 0; s < p.num_splits && merge.seen; ++s) {
    if (lse(s) == kEmptyRowLse) continue;
    const float w = merge.Weight(lse(s), [](float x) { return Exp2(x); });
    const float* o = p.o_partial + (first + s * per_batch) * dim;
    for (int d = 0; d < dim; ++d) out[d] += w * o[d];
    sum += w;
  }
  if (merge.seen) {
    const float inv = 1.f / sum;  // 0 when every split's scores were -inf: NaN, as dense
    for (int d = 0; d < dim; ++d) out[d] *= inv;
  }
  StoreRows(p.o, row * dim, 0, 1, dim, p.dtype, out);
  const int64_t head = within % sh.q_heads, q_row = within / sh.q_heads;
  p.lse[(b * sh.q_heads + head) * sh.q_len + q_row] =
      merge.seen ? (std::log2(sum) + merge.shift) * kLn2 : kEmptyRowLse;
}

}  // namespace

Status CpuAttentionForward(const FwdParams& p, const ParallelRunner& runner) {
  if (Status st = HeadDimRefusal(p.shape); !st.ok()) return st;
  const PackedRows packed = PackedRows::For(p.shape);
  const int64_t row_tiles = (packed.total + kRowsPerTile - 1) / kRowsPerTile;
  const int64_t items = p.shape.batch * p.shape.kv_heads * row_tiles * p.num_splits;
  const int64_t threads = CpuThreadsFor(p.shape, /*products=*/2);
  runner.For(items, [&p](int64_t item) {
    // Per-call scratch; large arrays stay off the worker's stack.
    thread_local std::vector<ForwardTile> tile(1);
    ForwardItem(p, item, tile[0]);
  }, threads);
  if (p.num_splits > 1) {
    runner.For(p.shape.batch * p.shape.q_len * p.shape.q_heads, [&p](int64_t row) {
      float out[kMaxHeadDim];
      MergeRow(p, row, out);
    }, threads);
  }
  return Status::Ok();
}

}  // namespace jaxflash
