// CPU forward: tiled online softmax, fp32 accumulation.
//
// One work item is (batch, query head, tile of kRowsPerTile rows). It streams
// the K/V tiles the mask policy says the rows can see, keeps a running max and
// sum per row in base 2 (log2(e) folded into the scale), and writes O and the
// LSE once. Memory beyond inputs and outputs: a few tiles per worker.
#include <algorithm>
#include <vector>

#include "jaxflash/launch.h"
#include "common/mask.h"
#include "cpu/tile.h"

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
};

JAXFLASH_CPU_CLONES void ForwardItem(const FwdParams& p, int64_t item, ForwardTile& t) {
  const AttentionShape& sh = p.shape;
  const int dim = static_cast<int>(sh.head_dim);
  const int64_t row_tiles = (sh.q_len + kRowsPerTile - 1) / kRowsPerTile;
  const int64_t b = item / (sh.q_heads * row_tiles);
  const int64_t h = (item / row_tiles) % sh.q_heads;
  const int r0 = static_cast<int>((item % row_tiles) * kRowsPerTile);
  const int rows = static_cast<int>(std::min<int64_t>(kRowsPerTile, sh.q_len - r0));
  const int64_t kv_head = h / sh.group_size();

  const MaskPolicy mask = MaskPolicy::For(p.mask, static_cast<int>(sh.q_len),
                                          static_cast<int>(sh.kv_len), p.q_lengths,
                                          p.kv_lengths, static_cast<int>(b));
  const int64_t q_offset = b * sh.q_batch_stride() + r0 * sh.q_row_stride() + h * dim;
  float* lse = p.lse + (b * sh.q_heads + h) * sh.q_len + r0;

  std::fill(t.acc, t.acc + rows * dim, 0.f);
  std::fill(t.row_max, t.row_max + rows, kNegInf);
  std::fill(t.row_sum, t.row_sum + rows, 0.f);

  const int valid_rows = std::min(rows, std::max(0, mask.q_valid - r0));
  const int key_begin = valid_rows > 0 ? mask.KeyBegin(r0) : 0;
  const int key_end = valid_rows > 0 ? mask.KeyEnd(r0 + valid_rows - 1) : 0;
  if (key_begin < key_end) {
    LoadRows(p.q, q_offset, sh.q_row_stride(), rows, dim, p.dtype, p.scale * kLog2e, t.q);
  }
  for (int c0 = key_begin; c0 < key_end; c0 += kKeysPerTile) {
    const int cols = std::min(kKeysPerTile, key_end - c0);
    const int64_t kv_offset = b * sh.kv_batch_stride() + c0 * sh.kv_row_stride() + kv_head * dim;
    LoadRowsTransposed(p.k, kv_offset, sh.kv_row_stride(), cols, dim, p.dtype, kKeysPerTile, t.kt);
    LoadRows(p.v, kv_offset, sh.kv_row_stride(), cols, dim, p.dtype, 1.f, t.v);
    RowsTimesTransposed(t.q, valid_rows, dim, t.kt, kKeysPerTile, cols, t.s, kKeysPerTile);

    const bool full = mask.TileIsFull(r0, r0 + valid_rows, c0, c0 + cols);
    for (int r = 0; r < valid_rows; ++r) {
      float* s = t.s + r * kKeysPerTile;
      if (!full) {
        for (int c = 0; c < cols; ++c) {
          if (!mask.Visible(r0 + r, c0 + c)) s[c] = kNegInf;
        }
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
      float* acc = t.acc + r * dim;
      for (int d = 0; d < dim; ++d) acc[d] *= rescale;
    }
    // O += P V; in a partly visible tile each row multiplies only the keys it
    // sees, so a NaN or Inf in the value of a masked key never reaches it.
    AccumulateVisible(full, t.s, kKeysPerTile, valid_rows, cols, t.v, dim, dim, t.acc, dim,
                      [&](int r) { return VisibleColsOf(mask, r0 + r, c0, cols); });
  }

  for (int r = 0; r < rows; ++r) {
    float* acc = t.acc + r * dim;
    if (!mask.HasKeys(r0 + r)) {
      std::fill(acc, acc + dim, 0.f);
      lse[r] = kEmptyRowLse;
      continue;
    }
    // As in a dense softmax: a row whose visible scores are all -inf has sum 0
    // and gets 0 / 0 = NaN; a +inf or NaN score makes the sum, and so the
    // whole row and its LSE, NaN.
    const float sum = t.row_sum[r];
    const float inv = 1.f / sum;
    for (int d = 0; d < dim; ++d) acc[d] *= inv;
    lse[r] = (t.row_max[r] + std::log2(sum)) * kLn2;
  }
  StoreRows(p.o, q_offset, sh.q_row_stride(), rows, dim, p.dtype, t.acc);
}

}  // namespace

Status CpuAttentionForward(const FwdParams& p, const ParallelRunner& runner) {
  if (p.shape.head_dim > kMaxHeadDim) {
    return Status::Unimplemented("CPU kernels support head_dim <= 256");
  }
  const int64_t row_tiles = (p.shape.q_len + kRowsPerTile - 1) / kRowsPerTile;
  const int64_t items = p.shape.batch * p.shape.q_heads * row_tiles;
  runner.For(items, [&p](int64_t item) {
    // Per-call scratch; large arrays stay off the worker's stack.
    thread_local std::vector<ForwardTile> tile(1);
    ForwardItem(p, item, tile[0]);
  });
  return Status::Ok();
}

}  // namespace jaxflash
