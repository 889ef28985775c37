// Exact recomputation of single rows of the forward and the backward, for the
// tensor-core epilogues.
//
// A tile product over a partly masked tile multiplies every masked pair by an
// exact zero weight, and 0 * NaN (or Inf) from the value, query or cotangent
// of a pair the mask hides would be NaN: a non-finite input would leak into
// rows that cannot see it. Every such leak leaves a NaN in the result, so the
// epilogues check their rows and hand the ones with a NaN to these functions,
// which recompute them pair by pair over the visible pairs only (the contract
// in params.h). They run only when an input is not finite, so they are written
// for clarity and for few registers, not for speed: one warp per row, 32
// output columns at a time (lane = column), every score and dP a dot product
// each lane computes whole from global memory, recomputed for each group of
// 32 columns. Nothing here stays live through the kernels' main loops.
#pragma once

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
// `v_row`): P, and dS when a backward needs it.
struct ExactPair {
  float prob, ds;
};
template <typename T>
__device__ __forceinline__ ExactPair PairOf(const T* q_row, const T* k_row, float scale, float lse, int dim) {
  return {Exp2((RowDot(q_row, k_row, dim) * scale - lse) * kLog2e), 0.f};
}
template <typename T>
__device__ __forceinline__ ExactPair PairOf(const BwdParams& p, const T* q_row, const T* do_row, const T* k_row,
                                           const T* v_row, int64_t stat) {
  const int dim = static_cast<int>(p.shape.head_dim);
  ExactPair pair = PairOf(q_row, k_row, p.scale, p.lse[stat], dim);
  pair.ds = pair.prob * (RowDot(do_row, v_row, dim) - p.delta[stat]);
  return pair;
}

// Element offsets of row `row` of (batch, head) in q-shaped tensors, and of
// key 0 of the head's K/V head in k-shaped ones.
__device__ __forceinline__ int64_t ExactQOffset(const AttentionShape& sh, int batch, int head, int row) {
  return batch * sh.q_batch_stride() + row * sh.q_row_stride() + head * sh.head_dim;
}
__device__ __forceinline__ int64_t ExactKvOffset(const AttentionShape& sh, int batch, int kv_head) {
  return batch * sh.kv_batch_stride() + kv_head * sh.head_dim;
}

// Query row `row` of (batch, head) with the keys it sees, [begin, end), and
// the K and V rows of its head (FwdParams or BwdParams).
template <typename T>
struct ExactQueryRow {
  int begin, end, dim;
  int64_t q_off, kv_stride;
  const T *k, *v;

  template <typename Params>
  __device__ __forceinline__ ExactQueryRow(const Params& p, int batch, int head, int row) {
    const AttentionShape& sh = p.shape;
    const MaskPolicy pol = MaskPolicy::ForBatch(p, batch);
    begin = pol.KeyBegin(row);
    end = pol.KeyEnd(row);
    dim = static_cast<int>(sh.head_dim);
    q_off = ExactQOffset(sh, batch, head, row);
    kv_stride = sh.kv_row_stride();
    const int64_t kv_off = ExactKvOffset(sh, batch, head / static_cast<int>(sh.group_size()));
    k = static_cast<const T*>(p.k) + kv_off;
    v = static_cast<const T*>(p.v) + kv_off;
  }
  __device__ __forceinline__ const T* Key(int j) const { return k + j * kv_stride; }
  __device__ __forceinline__ const T* Value(int j) const { return v + j * kv_stride; }
};

// One output row over the keys [r.begin, r.end) that row `r` (ExactQueryRow,
// or any type with its begin, end, dim, Key(j) and Value(j)) sees, given its
// (correct) natural-log LSE; store(d, value) writes column d (global memory,
// or a kernel's staging tile). An LSE of -inf (a split whose visible scores
// are all -inf) weighs every value 0, so only a non-finite value shows.
template <typename T, typename Row, typename Store>
__device__ __forceinline__ void ExactOutputOf(const Row& r, const T* q_row, float scale, float lse, int lane,
                                              Store&& store) {
  for (int c0 = 0; c0 < r.dim; c0 += 32) {
    const int d = c0 + lane;
    float acc = 0.f;
    for (int j = r.begin; j < r.end; ++j) {
      const float prob = lse == -INFINITY ? 0.f : PairOf(q_row, r.Key(j), scale, lse, r.dim).prob;
      if (d < r.dim) acc += prob * At(r.Value(j), d);
    }
    if (d < r.dim) store(d, acc);
  }
}

// Row `row` of O for (batch, head), given its (correct) natural-log LSE.
template <typename T, typename Store>
__device__ __forceinline__ void ExactOutputRow(const FwdParams& p, int batch, int head, int row, float lse,
                                               int lane, Store&& store) {
  const ExactQueryRow<T> r(p, batch, head, row);
  ExactOutputOf<T>(r, static_cast<const T*>(p.q) + r.q_off, p.scale, lse, lane, store);
}

// Row `row` of dQ for (batch, head).
template <typename T>
__device__ __forceinline__ void ExactQueryGradRow(const BwdParams& p, int batch, int head, int row, int lane) {
  const ExactQueryRow<T> r(p, batch, head, row);
  const int64_t stat = (int64_t(batch) * p.shape.q_heads + head) * p.shape.q_len + row;
  const T* q_row = static_cast<const T*>(p.q) + r.q_off;
  const T* do_row = static_cast<const T*>(p.dout) + r.q_off;
  for (int c0 = 0; c0 < r.dim; c0 += 32) {
    const int d = c0 + lane;
    float acc = 0.f;
    for (int j = r.begin; j < r.end; ++j) {
      const ExactPair pair = PairOf(p, q_row, do_row, r.Key(j), r.Value(j), stat);
      if (d < r.dim) acc += pair.ds * At(r.Key(j), d);
    }
    if (d < r.dim) static_cast<T*>(p.dq)[r.q_off + d] = ElemTraits<T>::FromFloat(acc * p.scale);
  }
}

// Key `key` of dK and dV for (batch, kv_head), summed over the GQA group;
// only the columns [d_begin, d_end) are written (a CTA that owns a column
// split writes its own).
template <typename T>
__device__ __forceinline__ void ExactKeyGradRow(const BwdParams& p, int batch, int kv_head, int key, int d_begin,
                                                int d_end, int lane) {
  const AttentionShape& sh = p.shape;
  const MaskPolicy pol = MaskPolicy::ForBatch(p, batch);
  const int dim = static_cast<int>(sh.head_dim);
  const int group = static_cast<int>(sh.group_size());
  const int64_t kv_off = ExactKvOffset(sh, batch, kv_head) + key * sh.kv_row_stride();
  const T* k_row = static_cast<const T*>(p.k) + kv_off;
  const T* v_row = static_cast<const T*>(p.v) + kv_off;
  // The rows that see the key, in every query head of the group, as one loop.
  const int row_begin = pol.RowBegin(key), rows = MaxInt(pol.RowEnd(key) - row_begin, 0);
  for (int c0 = d_begin; c0 < d_end; c0 += 32) {
    const int d = c0 + lane;
    float dk = 0.f, dv = 0.f;
    for (int i = 0; i < group * rows; ++i) {
      const int head = kv_head * group + i / rows, row = row_begin + i % rows;
      const int64_t q_off = ExactQOffset(sh, batch, head, row);
      const T* q_row = static_cast<const T*>(p.q) + q_off;
      const T* do_row = static_cast<const T*>(p.dout) + q_off;
      const ExactPair pair =
          PairOf(p, q_row, do_row, k_row, v_row, (int64_t(batch) * sh.q_heads + head) * sh.q_len + row);
      if (d < d_end) {
        dk += pair.ds * At(q_row, d);
        dv += pair.prob * At(do_row, d);
      }
    }
    if (d < d_end) {
      static_cast<T*>(p.dk)[kv_off + d] = ElemTraits<T>::FromFloat(dk * p.scale);
      static_cast<T*>(p.dv)[kv_off + d] = ElemTraits<T>::FromFloat(dv);
    }
  }
}

// Calls redo(r, row, src) once per row of this warp's accumulator tiles whose
// flag is set, with the whole warp: flags[r] (r = 2 mt + half) belongs to row
// row0 + 16 mt + g + 8 half, the four lanes of a quad agree on it, and lane
// `src` holds it (its per-row values can be shuffled from there).
template <int kRows, typename Redo>
__device__ __forceinline__ void ForEachFlaggedRow(const bool (&flags)[kRows], int row0, int lane, Redo&& redo) {
  bool any = false;
#pragma unroll
  for (int r = 0; r < kRows; ++r) any |= flags[r];
  if (__builtin_expect(!__any_sync(0xffffffffu, any), 1)) return;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    unsigned rows = __ballot_sync(0xffffffffu, flags[r] && (lane & 3) == 0);
    while (rows != 0) {
      const int src = __ffs(rows) - 1;
      rows &= rows - 1;
      redo(r, row0 + (r >> 1) * 16 + (src >> 2) + (r & 1) * 8, src);
    }
  }
}

}  // namespace tc
}  // namespace jaxflash
