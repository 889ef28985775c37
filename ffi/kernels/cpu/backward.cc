// CPU backward, in three parallel passes with no atomics and no shared
// accumulators, so results are identical run to run whatever the thread count:
//
//   1. delta = rowsum(dO * O) - dLSE          items: (batch, q head, row tile)
//   2. dK, dV for one key tile                items: (batch, kv head, key tile)
//      walks every query tile (and every query head of the GQA group) that
//      sees the key tile, accumulating in fp32 tiles.
//   3. dQ for one query tile                  items: (batch, q head, row tile)
//      walks the key tiles the rows see, recomputing P.
//
// Pass 3 recomputes QK^T and dO V^T once more than a fused dQ would (seven
// tile products instead of five), which buys determinism and O(T * H) extra
// memory: only delta. Where the caller gives room for float32 dQ sums
// (BwdParams::dq_accum; jaxflash/_native.py says where), passes 2 and 3 run as
// one with five products: items (batch, kv head), each adding dS K into rows
// only it owns (KeyValueAndQueryGradItem), just as deterministic (each dQ
// element adds its keys in the same order; a test compares the bits).
//
// Where each entry of a dense bias has one (batch, head) of the call and the
// call's rows and keys (BwdParams::ds_out, FFI jaxflash_bwd_db_v1), dB is dS:
// pass 2 (or 2 + 3) stores each visited tile's dS there, the hidden pairs' as
// 0, into the columns of its own key tile that it zeroed first (StoreScoreGrads).
// Otherwise the dense bias's gradient is a call of its own (CpuBiasGradient): pass 1,
// then pass 4, dB = dS summed over the bias's broadcast axes, whose items
// are the bias's own (batch, head, row tile): each owns its rows of dB and
// walks the broadcast batch elements, heads (and row tiles) itself, so no
// two items write one element and the sums' order is fixed.
#include <algorithm>
#include <vector>

#include "jaxflash/launch.h"
#include "common/alibi.h"
#include "common/mask.h"
#include "cpu/dense.h"
#include "cpu/tile.h"

namespace jaxflash {
namespace {

using namespace cpu;

struct Geometry {
  const BwdParams& p;
  int dim;   // of q and k
  int vdim;  // of v and o
  int64_t row_tiles;
  int64_t key_tiles;

  explicit Geometry(const BwdParams& params)
      : p(params),
        dim(static_cast<int>(params.shape.head_dim)),
        vdim(static_cast<int>(params.shape.v_dim())),
        row_tiles((params.shape.q_len + kRowsPerTile - 1) / kRowsPerTile),
        key_tiles((params.shape.kv_len + kKeysPerTile - 1) / kKeysPerTile) {}

  MaskPolicy Mask(int64_t b) const {
    return MaskPolicy::For(p.mask, static_cast<int>(p.shape.q_len),
                           static_cast<int>(p.shape.kv_len), p.q_lengths, p.kv_lengths,
                           static_cast<int>(b));
  }
  int64_t QOffset(int64_t b, int64_t h, int row) const {
    return b * p.shape.q_batch_stride() + row * p.shape.q_row_stride() + h * dim;
  }
  int64_t KvOffset(int64_t b, int64_t kv_head, int col) const {
    return b * p.shape.kv_batch_stride() + col * p.shape.kv_row_stride() + kv_head * dim;
  }
  // The same in o and dO, and in v and dV (the value's head dim).
  int64_t OOffset(int64_t b, int64_t h, int row) const {
    return b * p.shape.o_batch_stride() + row * p.shape.o_row_stride() + h * vdim;
  }
  int64_t VOffset(int64_t b, int64_t kv_head, int col) const {
    return b * p.shape.v_batch_stride() + col * p.shape.v_row_stride() + kv_head * vdim;
  }
  int64_t RowStatsOffset(int64_t b, int64_t h, int row) const {
    return (b * p.shape.q_heads + h) * p.shape.q_len + row;
  }
  int64_t Threads() const { return CpuBackwardThreads(p.shape); }
};

// Scratch for one work item of pass 2 or 3.
struct BackwardTile {
  float q[kRowsPerTile * kMaxHeadDim];
  float dout[kRowsPerTile * kMaxHeadDim];
  float kt[kMaxHeadDim * kKeysPerTile];   // K tile transposed
  float vt[kMaxHeadDim * kKeysPerTile];   // V tile transposed
  float k[kKeysPerTile * kMaxHeadDim];    // K tile (dQ's products)
  float s[kRowsPerTile * kKeysPerTile];   // probabilities P
  float ds[kRowsPerTile * kKeysPerTile];  // dP, then dS
  float lse2[kRowsPerTile];               // LSE in base 2
  float delta[kRowsPerTile];
  float bias[kKeysPerTile];               // one row's ALiBi bias (soft-capped calls)
  float acc_a[kKeysPerTile * kMaxHeadDim];  // dK (pass 2) or dQ (pass 3)
  float acc_b[kKeysPerTile * kMaxHeadDim];  // dV (pass 2)
  float st[kKeysPerTile * kRowsPerTile];    // P transposed (pass 2)
  float dst[kKeysPerTile * kRowsPerTile];   // dS transposed (pass 2)
};

BackwardTile& Scratch() {
  thread_local std::vector<BackwardTile> tile(1);
  return tile[0];
}

JAXFLASH_CPU_CLONES void DeltaItem(const Geometry& g, int64_t item) {
  const BwdParams& p = g.p;
  const int64_t b = item / (p.shape.q_heads * g.row_tiles);
  const int64_t h = (item / g.row_tiles) % p.shape.q_heads;
  const int r0 = static_cast<int>((item % g.row_tiles) * kRowsPerTile);
  const int rows = static_cast<int>(std::min<int64_t>(kRowsPerTile, p.shape.q_len - r0));
  const MaskPolicy mask = g.Mask(b);
  WithFormat(p.dtype, [&](auto format) {  // once per item, not per element
    using Format = decltype(format);
    const auto* dout = As<Format>(p.dout);
    const auto* o = As<Format>(p.o);
    for (int r = 0; r < rows; ++r) {
      const int64_t stat = g.RowStatsOffset(b, h, r0 + r);
      if (!mask.HasKeys(r0 + r)) {  // its dO (padding, say) must not reach any key
        p.delta[stat] = 0.f;
        continue;
      }
      const int64_t off = g.OOffset(b, h, r0 + r);
      float sum = 0.f;
      for (int d = 0; d < g.vdim; ++d) sum += Format::Load(dout[off + d]) * Format::Load(o[off + d]);
      p.delta[stat] = sum - p.dlse[stat];
    }
  });
}

// What the tile products of a tile may do (`ProbabilitiesAndScoreGrads`): run over
// the whole tile (`plain`), else over `cols_of` / `rows_of` spans, asking `sees`
// for each pair of a span that is not exact.
struct TileVisibility {
  const MaskPolicy& mask;
  const DenseRows& dense;
  int64_t h;
  int r0, c0;
  bool plain, mixed;  // mixed: the dense mask hides some pairs of the tile

  VisibleSpan ColsOf(int r, int cols) const {
    VisibleSpan span = VisibleColsOf(mask, r0 + r, c0, cols);
    span.exact &= !mixed;
    return span;
  }
  VisibleSpan RowsOf(int c, int rows) const {
    VisibleSpan span = VisibleRowsOf(mask, c0 + c, r0, rows);
    span.exact &= !mixed;
    return span;
  }
  bool Sees(int r, int c) const {
    return mask.SameSegment(r0 + r, c0 + c) && (!mixed || dense.Shows(h, r0 + r, c0 + c));
  }
};

// Loads the per-row statistics of rows [r0, r0 + rows) and fills t.s with the
// probabilities and t.ds with dS for the tile [r0, +rows) x [c0, +cols).
// Expects t.q, t.dout, t.kt, t.vt loaded. Returns how the callers' products may
// read the tile: whole when the masks admit all of it, or when a dense mask's
// hidden pairs were zeroed here and no operand holds a NaN or Inf; else only the
// visible pairs (masked entries of t.s and t.ds may hold NaN from non-finite inputs).
// `score_slope` false leaves a soft-capped call's dS with respect to the capped
// score (what the bias, added after the cap, receives) instead of the raw one.
TileVisibility ProbabilitiesAndScoreGrads(const Geometry& g, const MaskPolicy& mask, const DenseRows& dense,
                                          DenseRows::View view, int64_t b, int64_t h, int r0, int rows,
                                          int c0, int cols, BackwardTile& t, bool score_slope = true) {
  const BwdParams& p = g.p;
  const int64_t stat = g.RowStatsOffset(b, h, r0);
  for (int r = 0; r < rows; ++r) {
    // Rows that see no key carry kEmptyRowLse; +inf sends their P to 0.
    const float lse = p.lse[stat + r];
    t.lse2[r] = lse == kEmptyRowLse ? kPosInf : lse * kLog2e;
    t.delta[r] = p.delta[stat + r];
  }
  // t.q holds q * scale * log2(e), so s - lse2 is the base-2 exponent of P.
  RowsTimesTransposed(t.q, rows, g.dim, t.kt, kKeysPerTile, cols, t.s, kKeysPerTile);
  RowsTimesTransposed(t.dout, rows, g.vdim, t.vt, kKeysPerTile, cols, t.ds, kKeysPerTile);
  // (The eager reads, as the sm90 backward's step takes them: one test path
  // here for each of mask.h's two orders, the forward's the lazy one.)
  const bool full = mask.TileIsFull<true>(r0, r0 + rows, c0, c0 + cols);
  const bool mixed = view == DenseRows::View::kMixed;
  const bool capped = p.softcap > 0;
  const Alibi alibi = Alibi::Of(p.alibi, b, h, p.shape.q_heads);
  for (int r = 0; r < rows; ++r) {
    float* s = t.s + r * kKeysPerTile;
    float* ds = t.ds + r * kKeysPerTile;
    if (capped) SoftCap{p.softcap}.Apply(s, cols);
    // Rows with no visible key have LSE = -inf; masking first keeps them at 0.
    if (!full) HideUnseen(mask, r0 + r, c0, cols, s);
    if (mixed) dense.Hide(h, r0 + r, c0, cols, s);
    const float lse2 = t.lse2[r];
    if (capped) {
      // dS with respect to the uncapped score: times the cap's slope 1 - tanh^2
      // of the capped score (before ALiBi's bias, which only shifts P's exponent).
      const SoftCap cap{p.softcap};
      float* bias = t.bias;
      const float diagonal = Alibi::Diagonal(mask, r0 + r);
      for (int c = 0; c < cols; ++c) bias[c] = alibi.Bias(diagonal, static_cast<float>(c0 + c));
      dense.AddBias(h, r0 + r, c0, cols, bias);
      for (int c = 0; c < cols; ++c) {  // vectorised
        const float th = cap.TanhOf(s[c]);
        const float prob = Exp2(s[c] + bias[c] - lse2);
        s[c] = prob;
        ds[c] = prob * (ds[c] - t.delta[r]) * (score_slope ? 1.f - th * th : 1.f);
      }
      continue;
    }
    if (alibi.On()) {
      const float diagonal = Alibi::Diagonal(mask, r0 + r);
      for (int c = 0; c < cols; ++c) s[c] += alibi.Bias(diagonal, static_cast<float>(c0 + c));
    }
    dense.AddBias(h, r0 + r, c0, cols, s);
    for (int c = 0; c < cols; ++c) {  // vectorised
      const float prob = Exp2(s[c] - lse2);
      s[c] = prob;
      ds[c] = prob * (ds[c] - t.delta[r]);
    }
  }
  TileVisibility vis{mask, dense, h, r0, c0, full && !mixed, mixed};
  if (!vis.plain && p.dense.mask.On()) {
    // Exact zeros at every hidden pair; then finite operands let the products run
    // over the whole tile.
    for (int r = 0; r < rows; ++r) {
      const VisibleSpan span = vis.ColsOf(r, cols);
      for (int c = 0; c < cols; ++c) {
        const bool shown = c >= span.begin && c < span.end && (span.exact || vis.Sees(r, c));
        if (!shown) t.s[r * kKeysPerTile + c] = t.ds[r * kKeysPerTile + c] = 0.f;
      }
    }
    vis.plain = Finite(t.q, rows, g.dim, g.dim) && Finite(t.dout, rows, g.vdim, g.vdim) &&
                Finite(t.kt, g.dim, cols, kKeysPerTile) && Finite(t.vt, g.vdim, cols, kKeysPerTile);
  }
  return vis;
}

// Walks the key tiles rows [r0, r0 + rows) of (b, h) see (passes 3 and 4): loads
// their Q and dO rows once, then per tile the dense mask does not hide its K and V
// (transposed), P and dS, and calls visit(c0, cols, valid_rows, visibility), where
// valid_rows are the rows the lengths leave.
template <typename Visit>
void WalkKeyTiles(const Geometry& g, const MaskPolicy& mask, const DenseRows& dense, int64_t b, int64_t h,
                 int r0, int rows, BackwardTile& t, bool score_slope, Visit&& visit) {
  const BwdParams& p = g.p;
  const AttentionShape& sh = p.shape;
  const int valid_rows = std::min(rows, std::max(0, mask.q_valid - r0));
  const int key_begin = valid_rows > 0 ? mask.BlockKeyBegin(r0) : 0;
  const int key_end = valid_rows > 0 ? mask.BlockKeyEnd(r0 + valid_rows - 1) : 0;
  if (key_begin >= key_end) return;
  const int64_t q_off = g.QOffset(b, h, r0);
  LoadRows(p.q, q_off, sh.q_row_stride(), valid_rows, g.dim, p.dtype, p.scale * kLog2e, t.q);
  LoadRows(p.dout, g.OOffset(b, h, r0), sh.o_row_stride(), valid_rows, g.vdim, p.dtype, 1.f, t.dout);
  const int64_t kv_head = h / sh.group_size();
  for (int c0 = key_begin; c0 < key_end; c0 += kKeysPerTile) {
    const int cols = std::min(kKeysPerTile, key_end - c0);
    const auto view = dense.Tile(valid_rows, [&](int r) { return std::pair<int64_t, int>(h, r0 + r); }, c0, cols);
    if (view == DenseRows::View::kHidden) continue;
    const int64_t kv_off = g.KvOffset(b, kv_head, c0);
    LoadRowsTransposed(p.k, kv_off, sh.kv_row_stride(), cols, g.dim, p.dtype, kKeysPerTile, t.kt);
    LoadRowsTransposed(p.v, g.VOffset(b, kv_head, c0), sh.v_row_stride(), cols, g.vdim, p.dtype, kKeysPerTile,
                       t.vt);
    visit(c0, cols, valid_rows,
          ProbabilitiesAndScoreGrads(g, mask, dense, view, b, h, r0, valid_rows, c0, cols, t, score_slope));
  }
}

// dB = dS where the caller asks for it (ds_out): a tile's dS into its entries,
// the pairs the rows do not see as 0 (their dS may hold NaN unless the tile is
// plain). Each entry has one (batch, head), so no two items write it.
void StoreScoreGrads(const BwdParams& p, int64_t b, int64_t h, int r0, int rows, int c0, int cols,
                     const TileVisibility& vis, const BackwardTile& t) {
  const DenseTerm& out = p.ds_out;
  WithFormat(out.dtype, [&](auto format) {
    using Format = decltype(format);
    auto* dst = static_cast<typename Format::Storage*>(const_cast<void*>(out.data));
    for (int r = 0; r < rows; ++r) {
      const float* ds = t.ds + r * kKeysPerTile;
      const VisibleSpan span = vis.plain ? VisibleSpan{0, cols, true} : vis.ColsOf(r, cols);
      auto* row = dst + out.RowOffset(b, h, r0 + r) + int64_t(c0) * out.key_stride;
      for (int c = span.begin; c < span.end; ++c) {
        if (span.exact || vis.Sees(r, c)) row[c * out.key_stride] = Format::Store(ds[c]);
      }
    }
  });
}

// Zeroes the entries of dB (ds_out) of key columns [c0, c0 + cols) for the
// heads [h0, h_end) of batch element b: what StoreScoreGrads leaves alone.
void ZeroScoreGrads(const BwdParams& p, int64_t b, int64_t h0, int64_t h_end, int c0, int cols) {
  const DenseTerm& out = p.ds_out;
  WithFormat(out.dtype, [&](auto format) {
    using Format = decltype(format);
    auto* dst = static_cast<typename Format::Storage*>(const_cast<void*>(out.data));
    for (int64_t h = h0; h < h_end; ++h) {
      for (int64_t r = 0; r < p.shape.q_len; ++r) {
        auto* row = dst + out.RowOffset(b, h, r) + int64_t(c0) * out.key_stride;
        for (int c = 0; c < cols; ++c) row[c * out.key_stride] = Format::Store(0.f);
      }
    }
  });
}

// dK and dV of the key tile at c0 of (b, kv_head): walks every query tile (and
// every query head of the GQA group) that sees it, accumulating in fp32 tiles.
// With `dq_sums` (float32, laid out like q), also adds each query tile's dS K
// into its rows there (the fused scheme below); with dB out (ds_out), zeroes
// its columns of dB and stores each tile's dS there.
JAXFLASH_CPU_CLONES void KeyTileGrads(const Geometry& g, int64_t b, int64_t kv_head, int c0, float* dq_sums) {
  const BwdParams& p = g.p;
  const AttentionShape& sh = p.shape;
  const int dim = g.dim, vdim = g.vdim;
  const int cols = static_cast<int>(std::min<int64_t>(kKeysPerTile, sh.kv_len - c0));
  const MaskPolicy mask = g.Mask(b);
  const DenseRows dense{p.dense, b};
  BackwardTile& t = Scratch();

  std::fill(t.acc_a, t.acc_a + cols * dim, 0.f);
  std::fill(t.acc_b, t.acc_b + cols * vdim, 0.f);
  const int valid_cols = std::min(cols, std::max(0, mask.kv_valid - c0));
  // From a multiple of kRowGroup (up to three rows that see none of these keys
  // more), so that the dQ sums taken here group rows as QueryGradItem's row
  // tiles do and both schemes give the same bits.
  const int row_begin = valid_cols > 0 ? mask.BlockRowBegin(c0) / kRowGroup * kRowGroup : 0;
  const int row_end = valid_cols > 0 ? mask.BlockRowEnd(c0 + valid_cols - 1) : 0;
  const int64_t kv_off = g.KvOffset(b, kv_head, c0), v_off = g.VOffset(b, kv_head, c0);
  if (row_begin < row_end) {
    LoadRowsTransposed(p.k, kv_off, sh.kv_row_stride(), valid_cols, dim, p.dtype, kKeysPerTile, t.kt);
    LoadRowsTransposed(p.v, v_off, sh.v_row_stride(), valid_cols, vdim, p.dtype, kKeysPerTile, t.vt);
    if (dq_sums != nullptr) LoadRows(p.k, kv_off, sh.kv_row_stride(), valid_cols, dim, p.dtype, 1.f, t.k);
  }
  const float q_multiplier = p.scale * kLog2e;
  if (p.ds_out.On()) ZeroScoreGrads(p, b, kv_head * sh.group_size(), (kv_head + 1) * sh.group_size(), c0, cols);
  for (int64_t h = kv_head * sh.group_size(); h < (kv_head + 1) * sh.group_size(); ++h) {
    for (int r0 = row_begin; r0 < row_end; r0 += kRowsPerTile) {
      const int rows = std::min(kRowsPerTile, row_end - r0);
      const auto view = dense.Tile(rows, [&](int r) { return std::pair<int64_t, int>(h, r0 + r); }, c0, valid_cols);
      if (view == DenseRows::View::kHidden) continue;
      const int64_t q_off = g.QOffset(b, h, r0);
      LoadRows(p.q, q_off, sh.q_row_stride(), rows, dim, p.dtype, q_multiplier, t.q);
      LoadRows(p.dout, g.OOffset(b, h, r0), sh.o_row_stride(), rows, vdim, p.dtype, 1.f, t.dout);
      const TileVisibility vis = ProbabilitiesAndScoreGrads(g, mask, dense, view, b, h, r0, rows, c0, valid_cols, t);
      if (p.ds_out.On()) StoreScoreGrads(p, b, h, r0, rows, c0, valid_cols, vis, t);
      // dV += P^T dO; dK += dS^T Q, where t.q carries scale * log2(e) and ln 2
      // turns that back into scale. A partly visible tile multiplies, per key,
      // only the rows that see it.
      Transpose(t.s, kKeysPerTile, rows, valid_cols, 1.f, t.st, kRowsPerTile);
      Transpose(t.ds, kKeysPerTile, rows, valid_cols, kLn2, t.dst, kRowsPerTile);
      const auto rows_of = [&](int c) { return vis.RowsOf(c, rows); };
      const auto sees = [&](int c, int r) { return vis.Sees(r, c); };
      AccumulateVisible(vis.plain, t.st, kRowsPerTile, valid_cols, rows, t.dout, vdim, vdim, t.acc_b, vdim, rows_of,
                        sees);
      AccumulateVisible(vis.plain, t.dst, kRowsPerTile, valid_cols, rows, t.q, dim, dim, t.acc_a, dim, rows_of, sees);
      if (dq_sums != nullptr) {  // dQ += dS K, as pass 3 does it (the scale comes at the store)
        AccumulateVisible(vis.plain, t.ds, kKeysPerTile, rows, valid_cols, t.k, dim, dim, dq_sums + q_off,
                          static_cast<int>(sh.q_row_stride()), [&](int r) { return vis.ColsOf(r, valid_cols); },
                          [&](int r, int c) { return vis.Sees(r, c); });
      }
    }
  }
  StoreRows(p.dk, kv_off, sh.kv_row_stride(), cols, dim, p.dtype, t.acc_a);
  StoreRows(p.dv, v_off, sh.v_row_stride(), cols, vdim, p.dtype, t.acc_b);
}

JAXFLASH_CPU_CLONES void KeyValueGradItem(const Geometry& g, int64_t item) {
  const int64_t b = item / (g.p.shape.kv_heads * g.key_tiles);
  const int64_t kv_head = (item / g.key_tiles) % g.p.shape.kv_heads;
  KeyTileGrads(g, b, kv_head, static_cast<int>((item % g.key_tiles) * kKeysPerTile), nullptr);
}

// Passes 2 and 3 in one, when the caller gave room for dQ sums (dq_accum): the
// item (batch, kv head) walks its key tiles in order, adding dS K into the
// group's rows of dq_accum, which no other item touches, then stores them as
// dQ. Five tile products per pair instead of seven, with as little freedom
// of order as the three passes (so still identical run to run); the caller
// gives the room only where the items are enough to keep the threads busy.
JAXFLASH_CPU_CLONES void KeyValueAndQueryGradItem(const Geometry& g, int64_t item) {
  const BwdParams& p = g.p;
  const AttentionShape& sh = p.shape;
  const int64_t b = item / sh.kv_heads;
  const int64_t kv_head = item % sh.kv_heads;
  const int64_t h0 = kv_head * sh.group_size();
  const int64_t h_end = h0 + sh.group_size();
  float* sums = p.dq_accum;
  for (int r = 0; r < sh.q_len; ++r) {
    std::fill_n(sums + g.QOffset(b, h0, r), sh.group_size() * g.dim, 0.f);  // the group's heads are adjacent
  }
  for (int64_t tile = 0; tile < g.key_tiles; ++tile) {
    KeyTileGrads(g, b, kv_head, static_cast<int>(tile * kKeysPerTile), sums);
  }
  BackwardTile& t = Scratch();
  for (int64_t h = h0; h < h_end; ++h) {
    for (int r0 = 0; r0 < sh.q_len; r0 += kRowsPerTile) {
      const int rows = static_cast<int>(std::min<int64_t>(kRowsPerTile, sh.q_len - r0));
      const int64_t off = g.QOffset(b, h, r0);
      for (int r = 0; r < rows; ++r) {
        for (int d = 0; d < g.dim; ++d) t.acc_a[r * g.dim + d] = sums[off + r * sh.q_row_stride() + d] * p.scale;
      }
      StoreRows(p.dq, off, sh.q_row_stride(), rows, g.dim, p.dtype, t.acc_a);
    }
  }
}

JAXFLASH_CPU_CLONES void QueryGradItem(const Geometry& g, int64_t item) {
  const BwdParams& p = g.p;
  const AttentionShape& sh = p.shape;
  const int dim = g.dim;
  const int64_t b = item / (sh.q_heads * g.row_tiles);
  const int64_t h = (item / g.row_tiles) % sh.q_heads;
  const int r0 = static_cast<int>((item % g.row_tiles) * kRowsPerTile);
  const int rows = static_cast<int>(std::min<int64_t>(kRowsPerTile, sh.q_len - r0));
  const int64_t kv_head = h / sh.group_size();
  const MaskPolicy mask = g.Mask(b);
  const DenseRows dense{p.dense, b};
  BackwardTile& t = Scratch();

  std::fill(t.acc_a, t.acc_a + rows * dim, 0.f);
  WalkKeyTiles(g, mask, dense, b, h, r0, rows, t, /*score_slope=*/true,
               [&](int c0, int cols, int valid_rows, const TileVisibility& vis) {
    LoadRows(p.k, g.KvOffset(b, kv_head, c0), sh.kv_row_stride(), cols, dim, p.dtype, 1.f, t.k);
    // dQ += dS K, over each row's visible keys when the tile is partly masked.
    AccumulateVisible(vis.plain, t.ds, kKeysPerTile, valid_rows, cols, t.k, dim, dim, t.acc_a, dim,
                      [&](int r) { return vis.ColsOf(r, cols); }, [&](int r, int c) { return vis.Sees(r, c); });
  });
  for (int i = 0; i < rows * dim; ++i) t.acc_a[i] *= p.scale;
  StoreRows(p.dq, g.QOffset(b, h, r0), sh.q_row_stride(), rows, dim, p.dtype, t.acc_a);
}

// dB's dims: the call's where the bias has a stride, else 1.
struct BiasGrid {
  int64_t batches, heads, rows, keys;
  explicit BiasGrid(const BwdParams& p)
      : batches(p.dense.bias.batch_stride != 0 ? p.shape.batch : 1),
        heads(p.dense.bias.head_stride != 0 ? p.shape.q_heads : 1),
        rows(p.dense.bias.row_stride != 0 ? p.shape.q_len : 1),
        keys(p.dense.bias.key_stride != 0 ? p.shape.kv_len : 1) {}
  int64_t RowItems(const Geometry& g) const { return rows == 1 ? 1 : g.row_tiles; }
};

JAXFLASH_CPU_CLONES void BiasGradItem(const Geometry& g, const BiasGrid& grid, int64_t item) {
  const BwdParams& p = g.p;
  const AttentionShape& sh = p.shape;
  const int64_t row_items = grid.RowItems(g);
  const int64_t bb = item / (grid.heads * row_items);
  const int64_t hb = (item / row_items) % grid.heads;
  // This item's rows of dB: one row tile, or the single row of a bias broadcast over rows.
  const int out_r0 = grid.rows == 1 ? 0 : static_cast<int>((item % row_items) * kRowsPerTile);
  const int out_rows = grid.rows == 1 ? 1 : static_cast<int>(std::min<int64_t>(kRowsPerTile, sh.q_len - out_r0));
  // Summed in float32 here, then stored in dB's dtype.
  thread_local std::vector<float> sums;
  sums.assign(size_t(out_rows) * grid.keys, 0.f);
  BackwardTile& t = Scratch();

  const int64_t b_end = grid.batches == 1 ? sh.batch : bb + 1;
  const int64_t h_end = grid.heads == 1 ? sh.q_heads : hb + 1;
  const int r_end = grid.rows == 1 ? static_cast<int>(sh.q_len) : out_r0 + 1;
  for (int64_t b = grid.batches == 1 ? 0 : bb; b < b_end; ++b) {
    const MaskPolicy mask = g.Mask(b);
    const DenseRows dense{p.dense, b};
    for (int64_t h = grid.heads == 1 ? 0 : hb; h < h_end; ++h) {
      for (int r0 = out_r0; r0 < r_end; r0 += kRowsPerTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowsPerTile, sh.q_len - r0));
        WalkKeyTiles(g, mask, dense, b, h, r0, rows, t, /*score_slope=*/false,
                     [&](int c0, int cols, int valid_rows, const TileVisibility& vis) {
          // dS of the pairs the rows see (hidden ones may hold NaN unless the tile is plain).
          for (int r = 0; r < valid_rows; ++r) {
            const float* ds = t.ds + r * kKeysPerTile;
            float* dst = sums.data() + (grid.rows == 1 ? 0 : r0 + r - out_r0) * grid.keys;
            const VisibleSpan span = vis.plain ? VisibleSpan{0, cols, true} : vis.ColsOf(r, cols);
            float sum = 0.f;
            for (int c = span.begin; c < span.end; ++c) {
              if (!span.exact && !vis.Sees(r, c)) continue;
              if (grid.keys == 1) {
                sum += ds[c];
              } else {
                dst[c0 + c] += ds[c];
              }
            }
            if (grid.keys == 1) dst[0] += sum;
          }
        });
      }
    }
  }
  StoreRows(p.dbias, ((bb * grid.heads + hb) * grid.rows + out_r0) * grid.keys, grid.keys, out_rows,
            static_cast<int>(grid.keys), p.dbias_dtype, sums.data());
}

}  // namespace

// The threads the call is worth (launch.h): the backward's five products.
int64_t CpuBackwardThreads(const AttentionShape& sh) { return CpuThreadsFor(sh, /*products=*/5); }

Status CpuBiasGradient(const BwdParams& p, const ParallelRunner& runner) {
  if (Status st = HeadDimRefusal(p.shape); !st.ok()) return st;
  if (p.delta == nullptr || p.dbias == nullptr || !p.dense.bias.On()) {
    return Status::Internal("bias gradient called without its bias, output or delta scratch");
  }
  const Geometry g(p);
  const int64_t threads = g.Threads();
  runner.For(p.shape.batch * p.shape.q_heads * g.row_tiles, [&g](int64_t item) { DeltaItem(g, item); }, threads);
  const BiasGrid grid(p);
  runner.For(grid.batches * grid.heads * grid.RowItems(g),
             [&g, &grid](int64_t item) { BiasGradItem(g, grid, item); }, threads);
  return Status::Ok();
}

Status CpuAttentionBackward(const BwdParams& p, const ParallelRunner& runner) {
  if (Status st = HeadDimRefusal(p.shape); !st.ok()) return st;
  if (p.delta == nullptr) return Status::Internal("backward called without delta scratch");
  const DenseTerm& out = p.ds_out;
  if (out.On() && (out.Sharers(p.shape) != 1 || out.row_stride == 0 || out.key_stride == 0 || p.softcap > 0.f)) {
    return Status::InvalidArgument(
        "dB out of the CPU backward needs a bias whose every entry has one (batch, head) of the call and its "
        "rows and keys, without a soft-cap");
  }
  const Geometry g(p);
  const int64_t row_items = p.shape.batch * p.shape.q_heads * g.row_tiles;
  const int64_t threads = g.Threads();
  runner.For(row_items, [&g](int64_t item) { DeltaItem(g, item); }, threads);
  if (p.dq_accum != nullptr) {
    runner.For(p.shape.batch * p.shape.kv_heads, [&g](int64_t item) { KeyValueAndQueryGradItem(g, item); },
               threads);
    return Status::Ok();
  }
  runner.For(p.shape.batch * p.shape.kv_heads * g.key_tiles,
             [&g](int64_t item) { KeyValueGradItem(g, item); }, threads);
  runner.For(row_items, [&g](int64_t item) { QueryGradItem(g, item); }, threads);
  return Status::Ok();
}

}  // namespace jaxflash
