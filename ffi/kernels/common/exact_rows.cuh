// Exact recomputation of single rows of the forward and the backward, for the
// tensor-core epilogues.
//
// A tile product over a partly masked tile multiplies every masked pair by an
// exact zero weight, and 0 * NaN (or Inf) from the value, query or cotangent
// of a pair the mask hides would be NaN: a non-finite input would leak into
// rows that cannot see it. Every such leak leaves a NaN in the result, so the
// epilogues check the accumulator entries each lane holds and a lane that
// finds a NaN recomputes its own entries of that row pair by pair over the
// visible pairs only (the contract in params.h), into its registers, memory or
// a staging tile (the decode kernel, which flags rows in shared memory, gives
// a flagged row a whole warp instead). They run only when an input is not finite, so they
// are written for clarity and few registers, not for speed: every score and
// dP is a dot product the lane computes whole from global memory.
//
// Each lane works alone: no shuffle, vote or barrier. A warp collective placed
// after the epilogue's row-dependent branches hung the H100 whenever a warp
// held both real and padding query rows (q_len not a multiple of 16), so the
// recomputation must not need the other lanes.
#pragma once

#include "common/alibi.h"
#include "common/dense_tile.cuh"
#include "common/mask.h"
#include "common/mma.cuh"
#include "jaxflash/params.h"

namespace jaxflash {
namespace tc {

// sum_d a[d] * b[d], computed whole by every lane (the lanes read the same
// addresses, which the memory system broadcasts): no shuffles, so the loops
// around it need no warp-wide convergence.
template <typename T>
__device__ __forceinline__ float RowDot(const T* a, const T* b, int dim) {
  float sum = 0.f;
  for (int d = 0; d < dim; ++d) sum += ElemTraits<T>::ToFloat(a[d]) * ElemTraits<T>::ToFloat(b[d]);
  return sum;
}

template <typename T>
__device__ __forceinline__ float At(const T* row, int d) {
  return ElemTraits<T>::ToFloat(row[d]);
}

// The visible pair (query row `q_row` with its LSE and delta, key `k_row` /
// `v_row`): P, and dS when a backward needs it. `bias2` is the pair's ALiBi
// bias in log2 units (common/alibi.h; 0 without).
struct ExactPair {
  float prob, ds, slope;  // slope: d score / d (scale q·k), 1 - tanh^2 under a soft-cap
};
template <typename T>
__device__ __forceinline__ ExactPair PairOf(const T* q_row, const T* k_row, float scale, float softcap, float lse,
                                           int dim, float bias2 = 0.f) {
  float score = RowDot(q_row, k_row, dim) * scale, slope = 1.f;
  if (softcap > 0.f) {  // score_mod.cuh's cap in natural units, with tanhf
    const float th = tanhf(score / softcap);
    score = softcap * th;
    slope = 1.f - th * th;
  }
  return {Exp2((score - lse) * kLog2e + bias2), 0.f, slope};
}
// kOwnV: dO and v at the value's own head dim (else q and k's).
template <bool kOwnV = false, typename T>
__device__ __forceinline__ ExactPair PairOf(const BwdParams& p, const T* q_row, const T* do_row, const T* k_row,
                                           const T* v_row, int64_t stat, float bias2) {
  const int dim = static_cast<int>(p.shape.head_dim);
  const int vdim = kOwnV ? static_cast<int>(p.shape.v_dim()) : dim;
  ExactPair pair = PairOf(q_row, k_row, p.scale, p.softcap, p.lse[stat], dim, bias2);
  pair.ds = pair.prob * (RowDot(do_row, v_row, vdim) - p.delta[stat]) * pair.slope;
  return pair;
}

// Element offsets of row `row` of (batch, head) in q-shaped and o-shaped
// tensors, and of key 0 of the head's K/V head in k- and v-shaped ones (o and
// v take the value's head dim).
__device__ __forceinline__ int64_t ExactQOffset(const AttentionShape& sh, int batch, int head, int row) {
  return batch * sh.q_batch_stride() + row * sh.q_row_stride() + head * sh.head_dim;
}
__device__ __forceinline__ int64_t ExactOOffset(const AttentionShape& sh, int batch, int head, int row) {
  return batch * sh.o_batch_stride() + row * sh.o_row_stride() + head * sh.v_dim();
}
__device__ __forceinline__ int64_t ExactKvOffset(const AttentionShape& sh, int batch, int kv_head) {
  return batch * sh.kv_batch_stride() + kv_head * sh.head_dim;
}
__device__ __forceinline__ int64_t ExactVOffset(const AttentionShape& sh, int batch, int kv_head) {
  return batch * sh.v_batch_stride() + kv_head * sh.v_dim();
}

// Query row `row` of (batch, head) with the keys it sees, [begin, end), and
// the K and V rows of its head (FwdParams or BwdParams). kSegments: as
// MaskPolicy::For's (false in a kernel that never takes segment ids); kDense
// as DenseTile::Of's kTakes (false in a kernel that takes no dense term: its
// registers spilled the warp-specialised forward). kOwnV: v and o at the
// value's own head dim (a kernel of a pair, MLA); without, they are q and k's
// (the same values, computed without the registers that spilled D 128's
// warp-specialised forward).
template <typename T, bool kSegments = true, bool kDense = true, bool kOwnV = false>
struct ExactQueryRow {
  int begin, end, dim, vdim, row;  // dim: q and k's; vdim: v and o's
  int64_t q_off, o_off, kv_stride, v_stride;
  const T *k, *v;
  MaskPolicy pol;
  DenseTile dense;  // the call's dense bias and mask, if any

  template <typename Params>
  __device__ __forceinline__ ExactQueryRow(const Params& p, int batch, int head, int row_) {
    const AttentionShape& sh = p.shape;
    row = row_;
    pol = MaskPolicy::ForBatch<kSegments>(p, batch);
    begin = pol.KeyBegin(row);
    end = pol.KeyEnd(row);
    dim = static_cast<int>(sh.head_dim);
    q_off = ExactQOffset(sh, batch, head, row);
    kv_stride = sh.kv_row_stride();
    const int kv_head = head / static_cast<int>(sh.group_size());
    const int64_t kv_off = ExactKvOffset(sh, batch, kv_head);
    k = static_cast<const T*>(p.k) + kv_off;
    if constexpr (kOwnV) {
      vdim = static_cast<int>(sh.v_dim());
      o_off = ExactOOffset(sh, batch, head, row);
      v_stride = sh.v_row_stride();
      v = static_cast<const T*>(p.v) + ExactVOffset(sh, batch, kv_head);
    } else {
      vdim = dim;
      o_off = q_off;
      v_stride = kv_stride;
      v = static_cast<const T*>(p.v) + kv_off;
    }
    dense = DenseTile::Of<kDense>(p, batch, head);
  }
  __device__ __forceinline__ const T* Key(int j) const { return k + j * kv_stride; }
  __device__ __forceinline__ const T* Value(int j) const { return v + j * v_stride; }
  // Whether the row sees key j of [begin, end) (segment ids and a dense mask
  // can leave gaps).
  __device__ __forceinline__ bool Sees(int j) const { return pol.SameSegment(row, j) && dense.Shows(row, j); }
  // The dense bias of key j in log2 units (0 without one).
  __device__ __forceinline__ float DenseBias2(int j) const { return dense.Bias2(row, j); }
};

// One output row with the whole warp (lane = column; no shuffles), for the
// decode kernel, which flags rows in shared memory and gives each flagged row
// a warp: over the keys [r.begin, r.end) that row `r` (any type with begin,
// end, dim (q and k's), vdim (v and o's), Key(j), Value(j), Sees(j) and
// Bias(j), the pair's ALiBi bias in log2 units) sees, given its (correct)
// natural-log LSE; store(d, value) writes column d. An LSE of -inf (a split
// whose visible scores are all -inf) weighs every value 0, so only a
// non-finite value shows.
template <typename T, typename Row, typename Store>
__device__ __forceinline__ void ExactOutputOf(const Row& r, const T* q_row, float scale, float softcap, float lse,
                                              int lane, Store&& store) {
  for (int c0 = 0; c0 < r.vdim; c0 += 32) {
    const int d = c0 + lane;
    float acc = 0.f;
    for (int j = r.begin; j < r.end; ++j) {
      if (!r.Sees(j)) continue;
      const float prob = lse == -INFINITY ? 0.f : PairOf(q_row, r.Key(j), scale, softcap, lse, r.dim, r.Bias(j)).prob;
      if (d < r.vdim) acc += prob * At(r.Value(j), d);
    }
    if (d < r.vdim) store(d, acc);
  }
}

// The columns lane `t` of a quad holds in an m16 accumulator row:
// d_base + dt * 8 + 2t + {0, 1} for dt < kDT (those below `dim` are real).
template <int kDT, typename F>
__device__ __forceinline__ void ForLaneColumns(int t, int d_base, int dim, F&& f) {
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) {
    const int col = d_base + dt * 8 + 2 * t;
    if (col < dim) f(dt, col);
  }
}

// True when one of this lane's entries of accumulator row `half` is NaN.
template <int kDT>
__device__ __forceinline__ bool LaneHasNan(const float (&a)[kDT][4], int half) {
  bool nan = false;
#pragma unroll
  for (int dt = 0; dt < kDT; ++dt) nan |= isnan(a[dt][2 * half]) || isnan(a[dt][2 * half + 1]);
  return nan;
}

// This lane's entries of row `row` of O for (batch, head), given the row's
// (correct) natural-log LSE: store(dt, x) receives columns col_base + dt * 8 +
// 2t + {0, 1} as x.x, x.y (col_base: where a warpgroup's share of the columns
// starts). One column pair at a time, in a loop the compiler keeps rolled,
// so the registers stay few: the callers hold a whole accumulator tile or have
// just staged it. kOwnV: as ExactQueryRow's.
template <typename T, int kDT, bool kSegments = true, bool kDense = false, bool kOwnV = false, typename Store>
__device__ __forceinline__ void ExactOutputLane(const FwdParams& p, int batch, int head, int row, float lse, int t,
                                                Store&& store, int col_base = 0) {
  const ExactQueryRow<T, kSegments, kDense, kOwnV> r(p, batch, head, row);
  const T* q_row = static_cast<const T*>(p.q) + r.q_off;
  const Alibi alibi = Alibi::Of(p.alibi, batch, head, p.shape.q_heads);
  const float diagonal = Alibi::Diagonal(r.pol, row);
#pragma unroll 1
  for (int dt = 0; dt < kDT; ++dt) {
    const int col = col_base + dt * 8 + 2 * t;
    if (col >= r.vdim) break;
    float2 acc = make_float2(0.f, 0.f);
    for (int j = r.begin; j < r.end; ++j) {
      if (!r.Sees(j)) continue;
      const float bias2 = alibi.Bias(diagonal, static_cast<float>(j)) + r.DenseBias2(j);
      const float prob = PairOf(q_row, r.Key(j), p.scale, p.softcap, lse, r.dim, bias2).prob;
      acc.x += prob * At(r.Value(j), col);
      acc.y += prob * At(r.Value(j), col + 1);
    }
    store(dt, acc);
  }
}

// Row `row` of dQ / scale for (batch, head) in the columns a thread holds:
// for_columns(f) calls f(col, x, y) for each pair (col, col + 1) of them,
// with x and y the thread's floats for those columns. A row with a NaN LSE or
// delta is NaN throughout anyway: its values are left as they are.
template <typename T, bool kOwnV = false, typename ForColumns>
__device__ __forceinline__ void ExactQueryGrad(const BwdParams& p, int batch, int head, int row,
                                               ForColumns&& for_columns) {
  const int64_t stat = (int64_t(batch) * p.shape.q_heads + head) * p.shape.q_len + row;
  if (!isfinite(p.lse[stat]) || !isfinite(p.delta[stat])) return;
  const ExactQueryRow<T, true, true, kOwnV> r(p, batch, head, row);
  const T* q_row = static_cast<const T*>(p.q) + r.q_off;
  const T* do_row = static_cast<const T*>(p.dout) + r.o_off;
  const Alibi alibi = Alibi::Of(p.alibi, batch, head, p.shape.q_heads);
  const float diagonal = Alibi::Diagonal(r.pol, row);
  for_columns([&](int, float& x, float& y) { x = y = 0.f; });
  for (int j = r.begin; j < r.end; ++j) {
    if (!r.Sees(j)) continue;
    const float bias2 = alibi.Bias(diagonal, static_cast<float>(j)) + r.DenseBias2(j);
    const float ds = PairOf<kOwnV>(p, q_row, do_row, r.Key(j), r.Value(j), stat, bias2).ds;
    const T* k = r.Key(j);
    for_columns([&](int col, float& x, float& y) {
      x += ds * At(k, col);
      y += ds * At(k, col + 1);
    });
  }
}
// ... a lane's entries of accumulator row `half`,
template <typename T, int kDT, bool kOwnV = false>
__device__ __forceinline__ void ExactQueryGradLane(const BwdParams& p, int batch, int head, int row, int t,
                                                float (&dq)[kDT][4], int half) {
  const int dim = static_cast<int>(p.shape.head_dim);
  ExactQueryGrad<T, kOwnV>(p, batch, head, row, [&](auto&& f) {
    ForLaneColumns<kDT>(t, 0, dim, [&](int dt, int col) { f(col, dq[dt][2 * half], dq[dt][2 * half + 1]); });
  });
}
// ... or columns [col0, col0 + 8) of a row-wise pass.
// (The dQ conversion pass runs every call: the value's own width is asked
// at run time, on this cold path.)
template <typename T>
__device__ __forceinline__ void ExactQueryGradColumns(const BwdParams& p, int batch, int head, int row, int col0,
                                                   float (&dq)[8]) {
  auto columns = [&](auto&& f) {
#pragma unroll
    for (int i = 0; i < 8; i += 2) f(col0 + i, dq[i], dq[i + 1]);
  };
  if (p.shape.v_dim() != p.shape.head_dim) {
    ExactQueryGrad<T, true>(p, batch, head, row, columns);
  } else {
    ExactQueryGrad<T>(p, batch, head, row, columns);
  }
}

// This lane's entries of key `key`'s rows of dK / scale (columns from
// dk_base) and dV (from dv_base) for (batch, kv_head), summed over the GQA
// group.
template <typename T, bool kOwnV = false, int kKT, int kVT>
__device__ __forceinline__ void ExactKeyGradLane(const BwdParams& p, int batch, int kv_head, int key, int t,
                                              int half, float (&dk)[kKT][4], int dk_base, float (&dv)[kVT][4],
                                              int dv_base) {
  const AttentionShape& sh = p.shape;
  const MaskPolicy pol = MaskPolicy::ForBatch(p, batch);
  const int dim = static_cast<int>(sh.head_dim);
  const int group = static_cast<int>(sh.group_size());
  const int64_t kv_off = ExactKvOffset(sh, batch, kv_head) + key * sh.kv_row_stride();
  const T* k_row = static_cast<const T*>(p.k) + kv_off;
  const T* v_row = static_cast<const T*>(p.v) +
                   (kOwnV ? ExactVOffset(sh, batch, kv_head) + key * sh.v_row_stride() : kv_off);
  const int vdim = kOwnV ? static_cast<int>(sh.v_dim()) : dim;
  ForLaneColumns<kKT>(t, dk_base, dim, [&](int dt, int) { dk[dt][2 * half] = dk[dt][2 * half + 1] = 0.f; });
  ForLaneColumns<kVT>(t, dv_base, vdim, [&](int dt, int) { dv[dt][2 * half] = dv[dt][2 * half + 1] = 0.f; });
  // The rows that see the key, in every query head of the group, as one loop.
  const int row_begin = pol.RowBegin(key), rows = MaxInt(pol.RowEnd(key) - row_begin, 0);
  for (int i = 0; i < group * rows; ++i) {
    const int head = kv_head * group + i / rows, row = row_begin + i % rows;
    const DenseTile dense = DenseTile::Of(p, batch, head);
    if (!pol.SameSegment(row, key) || !dense.Shows(row, key)) continue;
    const int64_t q_off = ExactQOffset(sh, batch, head, row);
    const T* q_row = static_cast<const T*>(p.q) + q_off;
    const T* do_row = static_cast<const T*>(p.dout) + (kOwnV ? ExactOOffset(sh, batch, head, row) : q_off);
    const float bias2 = Alibi::Of(p.alibi, batch, head, sh.q_heads).Bias(Alibi::Diagonal(pol, row), float(key)) +
                        dense.Bias2(row, key);
    const ExactPair pair =
        PairOf<kOwnV>(p, q_row, do_row, k_row, v_row, (int64_t(batch) * sh.q_heads + head) * sh.q_len + row, bias2);
    ForLaneColumns<kKT>(t, dk_base, dim, [&](int dt, int col) {
      dk[dt][2 * half] += pair.ds * At(q_row, col);
      dk[dt][2 * half + 1] += pair.ds * At(q_row, col + 1);
    });
    ForLaneColumns<kVT>(t, dv_base, vdim, [&](int dt, int col) {
      dv[dt][2 * half] += pair.prob * At(do_row, col);
      dv[dt][2 * half + 1] += pair.prob * At(do_row, col + 1);
    });
  }
}

}  // namespace tc
}  // namespace jaxflash
