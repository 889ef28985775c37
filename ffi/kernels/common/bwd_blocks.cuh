// Pieces of the tensor-core backward shared by the sm80 (mma.sync) and sm90
// (wgmma) kernels: the delta pre-pass, the query tiles a key tile is seen by,
// the two element-wise steps (P from the scores, dS from P and dP) in both
// orientations, and the epilogues that write dK/dV and dQ.
//
// Gradient algebra (natural-log LSE L, scale c):
//   P = exp(c·S - L),  dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ∘ (dP - delta),
//   dK = c·dSᵀ·Q,  dQ = c·dS·K,  delta = rowsum(dO ∘ O) - dL.
//
// Tiles are held in the mma.sync accumulator layout (mma.cuh), which is also
// one warp's share of a wgmma accumulator: lane (g, t) holds rows g and g + 8
// of the warp's 16 rows, columns 8 nt + 2t and 8 nt + 2t + 1. The dK/dV
// kernels compute Sᵀ and dPᵀ ("key-major": rows are keys, columns queries),
// the dQ kernels S and dP ("query-major").
#pragma once

#include <cuda_runtime.h>

#include "common/dense_tile.cuh"
#include "common/exact_rows.cuh"
#include "common/launch_util.cuh"
#include "common/mask.h"
#include "common/mma.cuh"
#include "common/score_mod.cuh"
#include "common/segment_mask.cuh"
#include "jaxflash/params.h"

namespace jaxflash {
namespace tc {

// ------------------------------------------------------------ row-wise passes
// The delta pre-pass and the fused backward's dQ conversion stream q-shaped
// rows: a group of RowLanes(D) lanes per row ([b][t][h] order, so a CTA reads
// one contiguous range), each lane one 16-byte chunk of 8 elements per round
// (head_dim % 8 == 0). One row per warp left half the lanes idle at D 128 and
// each warp with a single row's loads in flight: 2.0-2.45 TB/s
// (docs/performance.md, twelfth session).
constexpr int kRowPassThreads = 256;
// Rows a thread of the dQ conversion streams at once: the loads of all of
// them are issued before any is used. With one row a thread (72 registers,
// three CTAs an SM, 32 bytes of loads in flight a thread) it ran at the H100's
// copy rate but at 2.9 of an H200's ~4 TB/s; four: 69 -> 58 us at B·S 16k,
// H·D 2048. The delta pass keeps one row a thread: four made it 91 -> 96 us
// (H200, forty-ninth session, docs/performance-log.md).
constexpr int kQueryGradRows = 4;
constexpr int kDeltaRows = 1;
// 16-byte chunks a lane of the delta pass loads from each of O and dO: one a
// lane left the pass issue-bound beside its loads (SM 63.7%, DRAM 65% at D
// 128: each thread's row set-up for 32 bytes; H200, fiftieth session).
constexpr int kDeltaChunks = 2;
// Lanes a row, each `chunks` 16-byte chunks of 8 elements.
__host__ __device__ __forceinline__ int RowLanes(int64_t head_dim, int chunks = 1) {
  int lanes = 1;
  while (lanes < 32 && lanes * 8 * chunks < head_dim) lanes *= 2;
  return lanes;
}
// One of a thread's rows and its chunk within the row; rows past the batch
// element's q_len · q_heads are not real. A CTA's j-th rows are one
// contiguous range, so each round of loads is coalesced.
struct RowPassThread {
  int batch, t, h, lane_in_row, lanes;
  bool real;
  int64_t off;  // of the row in q-shaped tensors
  template <int kRows, int kChunks = 1>
  __device__ __forceinline__ static RowPassThread At(const AttentionShape& sh, int batch, int j) {
    RowPassThread r;
    r.lanes = RowLanes(sh.head_dim, kChunks);
    const int64_t rows_per_cta = kRowPassThreads / r.lanes;
    const int64_t row = (int64_t(blockIdx.x) * kRows + j) * rows_per_cta + threadIdx.x / r.lanes;
    r.batch = batch;
    r.lane_in_row = threadIdx.x % r.lanes;
    r.real = row < sh.q_len * sh.q_heads;
    if (sh.q_len * sh.q_heads <= UINT32_MAX) {  // a 32-bit division is a fifth of a 64-bit one
      const uint32_t row32 = static_cast<uint32_t>(row), heads = static_cast<uint32_t>(sh.q_heads);
      r.t = static_cast<int>(row32 / heads);
      r.h = static_cast<int>(row32 - uint32_t(r.t) * heads);
    } else {
      r.t = static_cast<int>(row / sh.q_heads);
      r.h = static_cast<int>(row % sh.q_heads);
    }
    r.off = batch * sh.q_batch_stride() + r.t * sh.q_row_stride() + r.h * sh.head_dim;
    return r;
  }
  // The lanes of this thread's row (a real row's lanes are all real).
  __device__ __forceinline__ unsigned RowMask() const {
    const int first = (threadIdx.x & 31) - lane_in_row;
    return lanes == 32 ? 0xffffffffu : ((1u << lanes) - 1u) << first;
  }
  __device__ __forceinline__ int64_t Stat(const AttentionShape& sh) const {  // in [b][h][t] statistics
    return (int64_t(batch) * sh.q_heads + h) * sh.q_len + t;
  }
  // Calls f(rows), this thread's kRows rows (real or not), for each batch
  // element the CTA walks.
  template <int kRows, int kChunks = 1, typename F>
  __device__ __forceinline__ static void ForEach(const AttentionShape& sh, F&& f) {
    for (int batch = blockIdx.y; batch < sh.batch; batch += gridDim.y) {
      RowPassThread rows[kRows];
#pragma unroll
      for (int j = 0; j < kRows; ++j) rows[j] = At<kRows, kChunks>(sh, batch, j);
      f(rows);
    }
  }
};
// The grid of a row-wise pass of kRows rows a thread: row blocks by batch
// elements (a batch beyond the grid's y limit is walked by the CTAs).
template <int kRows, int kChunks = 1>
inline dim3 RowPassGrid(const AttentionShape& sh) {
  const int64_t rows_per_cta = kRowPassThreads / RowLanes(sh.head_dim, kChunks) * kRows;
  return dim3(static_cast<unsigned>(CeilDiv(sh.q_len * sh.q_heads, rows_per_cta)),
              static_cast<unsigned>(sh.batch < 65535 ? sh.batch : 65535));
}

// ------------------------------------------------------------ delta
// The delta pass's CTAs an SM: six on sm_90 (40 registers; with two chunks a
// lane it took 42-44, so five), five on sm_80, whose code spills 8 bytes at 40.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr int kDeltaCtasPerSm = 6;
#else
constexpr int kDeltaCtasPerSm = 5;
#endif
// delta[b][h][t] = rowsum(dO * O) - dLSE; 0 for a row that sees no key, whose
// dO (padding, say) must reach no key through a masked pair's zero weight.
// The same lanes zero the row of the fused backward's dQ sums (p.dq_accum,
// laid out like q) when there is one. kOwnV: O and dO at the value's own head
// dim (their rows at o's strides).
template <typename T, bool kOwnV = false>
__global__ void __launch_bounds__(kRowPassThreads, kDeltaCtasPerSm) DeltaKernel(const BwdParams p) {
  const AttentionShape& sh = p.shape;
  RowPassThread::ForEach<kDeltaRows, kDeltaChunks>(sh, [&](const RowPassThread (&rows)[kDeltaRows]) {
    const int lane = rows[0].lane_in_row, lanes = rows[0].lanes;
    const MaskPolicy mask = MaskPolicy::ForBatch(p, rows[0].batch);
#pragma unroll
    for (int j = 0; j < kDeltaRows; ++j) {
      const RowPassThread& r = rows[j];
      if (!r.real) continue;
      if (p.dq_accum) {
        float* sums = p.dq_accum + r.off;
        for (int c = lane * 4; c < sh.head_dim; c += lanes * 4) *reinterpret_cast<float4*>(sums + c) = float4{};
      }
      const int64_t o_off = kOwnV ? r.batch * sh.o_batch_stride() + r.t * sh.o_row_stride() + r.h * sh.v_dim() : r.off;
      const int64_t o_dim = kOwnV ? sh.v_dim() : sh.head_dim;
      const T* o = static_cast<const T*>(p.o) + o_off;
      const T* d_o = static_cast<const T*>(p.dout) + o_off;
      float acc = 0.f;
      // kDeltaChunks chunks at a time, every load issued before any is used.
      for (int c0 = lane * 8; c0 < o_dim; c0 += lanes * 8 * kDeltaChunks) {
        uint4 ov[kDeltaChunks], dv[kDeltaChunks];
#pragma unroll
        for (int u = 0; u < kDeltaChunks; ++u) {
          const int c = c0 + u * lanes * 8;
          ov[u] = c < o_dim ? *reinterpret_cast<const uint4*>(o + c) : uint4{};
          dv[u] = c < o_dim ? *reinterpret_cast<const uint4*>(d_o + c) : uint4{};
        }
#pragma unroll
        for (int u = 0; u < kDeltaChunks; ++u) {
          const T* oe = reinterpret_cast<const T*>(&ov[u]);
          const T* de = reinterpret_cast<const T*>(&dv[u]);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc += ElemTraits<T>::ToFloat(oe[i]) * ElemTraits<T>::ToFloat(de[i]);
        }
      }
      // The row's lanes are an aligned group of a power of two: xor stays inside.
      for (int off_lane = lanes / 2; off_lane > 0; off_lane >>= 1) acc += __shfl_xor_sync(r.RowMask(), acc, off_lane);
      if (lane == 0) {
        const int64_t idx = r.Stat(sh);
        p.delta[idx] = mask.HasKeys(r.t) ? acc - (p.dlse ? p.dlse[idx] : 0.f) : 0.f;
      }
    }
  });
}

// Launches DeltaKernel on every (batch, row, head); nothing when there are none.
template <typename T>
Status LaunchDelta(const BwdParams& p, cudaStream_t stream) {
  const AttentionShape& sh = p.shape;
  if (sh.batch * sh.q_len * sh.q_heads == 0) return Status::Ok();
  if (sh.v_dim() != sh.head_dim) {
    DeltaKernel<T, true><<<RowPassGrid<kDeltaRows, kDeltaChunks>(sh), kRowPassThreads, 0, stream>>>(p);
  } else {
    DeltaKernel<T><<<RowPassGrid<kDeltaRows, kDeltaChunks>(sh), kRowPassThreads, 0, stream>>>(p);
  }
  return CheckLaunch("attention backward (delta)");
}

// The launch shape of one backward kernel: rows (keys for dK/dV, queries for
// dQ) per CTA, CTAs sharing those rows (column splits), threads, shared memory.
struct BwdLaunch {
  int rows, splits, threads;
  size_t smem;
};

// The backward's passes in order: delta, then the caller's key pass (dK, dV)
// and query pass (dQ). q_len == 0 or kv_len == 0 leaves one of them without
// work; the other still writes its zeros (dK = dV = 0 with no queries, dQ = 0
// with no keys).
template <typename T, typename KeyPass, typename QueryPass>
Status RunBackwardPasses(const BwdParams& p, cudaStream_t stream, KeyPass&& key_pass, QueryPass&& query_pass) {
  const AttentionShape& sh = p.shape;
  if (sh.batch == 0 || sh.q_heads == 0) return Status::Ok();
  Status st = LaunchDelta<T>(p, stream);
  if (!st.ok()) return st;
  if (sh.kv_len > 0 && !(st = key_pass()).ok()) return st;
  if (sh.q_len > 0) st = query_pass();
  return st;
}

// The backward of either tensor-core family with the grid-shaped dQ kernel
// over (query blocks, heads, batch) as its query pass.
template <typename T, auto DqKernel, typename KeyPass>
Status RunBackwardKernels(const BwdParams& p, BwdLaunch dq, const CudaDevice& device, cudaStream_t stream,
                          KeyPass&& key_pass) {
  Status st = EnsureDynamicSmem<DqKernel>(dq.smem, device);
  if (!st.ok()) return st;
  return RunBackwardPasses<T>(p, stream, key_pass, [&] {
    const AttentionShape& sh = p.shape;
    const dim3 grid(static_cast<unsigned>(CeilDiv(sh.q_len, dq.rows)), static_cast<unsigned>(sh.q_heads),
                    static_cast<unsigned>(sh.batch));
    DqKernel<<<grid, dq.threads, dq.smem, stream>>>(p);
    return CheckLaunch("attention backward (dQ)");
  });
}

// The two-kernel backward: the dK/dV kernel over (key blocks, kv heads,
// batch x splits), then the dQ kernel.
template <typename T, auto DkDvKernel, auto DqKernel>
Status LaunchBackwardKernels(const BwdParams& p, BwdLaunch dkdv, BwdLaunch dq, const CudaDevice& device,
                             cudaStream_t stream) {
  Status st = EnsureDynamicSmem<DkDvKernel>(dkdv.smem, device);
  if (!st.ok()) return st;
  return RunBackwardKernels<T, DqKernel>(p, dq, device, stream, [&] {
    const AttentionShape& sh = p.shape;
    const dim3 grid(static_cast<unsigned>(CeilDiv(sh.kv_len, dkdv.rows)), static_cast<unsigned>(sh.kv_heads),
                    static_cast<unsigned>(sh.batch * dkdv.splits));
    DkDvKernel<<<grid, dkdv.threads, dkdv.smem, stream>>>(p);
    return CheckLaunch("attention backward (dK, dV)");
  });
}

// ------------------------------------------------------------ query tiles of a key tile
// Query tiles of kM rows that see at least one of keys [c0, c0 + kN):
// [begin, begin + count) per query head of the group.
struct QueryTiles {
  int begin = 0;
  int count = 0;
};
template <int kM, int kN>
__device__ __forceinline__ QueryTiles QueryTileRange(const MaskPolicy& pol, int c0) {
  QueryTiles tiles;
  const int c_end = MinInt(c0 + kN, pol.kv_valid);
  if (c_end > c0) {
    const int row_begin = pol.BlockRowBegin(c0);
    const int row_end = pol.BlockRowEnd(c_end - 1);
    if (row_end > row_begin) {
      tiles.begin = row_begin / kM;
      tiles.count = (row_end + kM - 1) / kM - tiles.begin;
    }
  }
  return tiles;
}

// ------------------------------------------------------------ key-major element-wise steps
// Zeroes entries s[nt][2 half + j] whose position nt * 8 + j lies outside
// [lo, hi): the mask on one fragment half of a boundary tile (a key's query
// rows, or a row's keys, measured from the lane's first one).
template <int kT>
__device__ __forceinline__ void ZeroOutside(float (&s)[kT][4], int half, int lo, int hi) {
#pragma unroll
  for (int nt = 0; nt < kT; ++nt)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int at = nt * 8 + j;
      if (at < lo || at >= hi) s[nt][2 * half + j] = 0.f;
    }
}

// Scores times `scale_log2` (the multiplier the exponent would still apply),
// for a term added in log2 units; returns the exponent's multiplier now, 1.
template <int kT>
__device__ __forceinline__ float InLog2Units(float (&s)[kT][4], float scale_log2) {
#pragma unroll
  for (int nt = 0; nt < kT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[nt][i] *= scale_log2;
  return 1.f;
}

// The backward's score modifiers before the exponent: a soft-cap caps the raw
// products (into log2 units), and where ALiBi's bias follows the products are
// scaled first, so it adds in log2 units. Returns the multiplier the exponent
// still applies: scale_log2 for plain calls, 1 once the scores are in log2 units.
// `kept` (score_mod.cuh's KeptTanh) receives the tanh of capped scores.
template <int kT, typename Kept = NoKeptTanh>
__device__ __forceinline__ float ModifyScores(float (&s)[kT][4], SoftCap cap, const AlibiBias& alibi,
                                              float scale_log2, Kept&& kept = {}) {
  if (cap.On()) {
#pragma unroll
    for (int nt = 0; nt < kT; ++nt)
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        const float a = cap.Tanh(s[nt][2 * pair]), b = cap.Tanh(s[nt][2 * pair + 1]);
        kept.Keep(nt, pair, a, b);
        s[nt][2 * pair] = cap.cap2 * a;
        s[nt][2 * pair + 1] = cap.cap2 * b;
      }
    scale_log2 = 1.f;
  }
  if (alibi.On()) scale_log2 = InLog2Units(s, scale_log2);
  return scale_log2;
}

// Sᵀ -> Pᵀ in place for query tile [r0, r0 + 8 kQT) and this warp's keys from
// `key0`. lse holds the tile's natural-log LSE values. `full`: the mask admits
// the whole tile (queries past q_valid never make a tile full); only other
// tiles run the mask loop, one uniform branch per tile. A test inside the
// exponent loop made ptxas branch around every element: 28% of the fused
// kernel's samples at D 128 (docs/performance.md, eleventh session).
// LseLog2(nt, j): this lane's query column nt * 8 + 2t + j's LSE in log2
// units (read from `lse` as it goes, or from registers read earlier).
// `cap` (score_mod.cuh, built with the call's scale) caps the scores before
// the exponent instead of scaling them (masked pairs are zeroed after it, as
// without a cap); `alibi` adds ALiBi's bias after the cap.
// `kept`: as ModifyScores. `dense` (dense_tile.cuh; null: none) adds its bias
// and hides its mask's pairs after ALiBi.
template <int kQT, typename LseLog2, typename Kept = NoKeptTanh>
__device__ __forceinline__ void KeyMajorProbsFrom(float (&s)[kQT][4], const MaskPolicy& pol, bool full, int r0,
                                                  int key0, LseLog2&& lse_at, int lane, float scale_log2,
                                                  SoftCap cap = {}, AlibiBias alibi = {}, Kept&& kept = {},
                                                  const DenseTile* dense = nullptr) {
  const int g = lane >> 2, t = lane & 3;
  scale_log2 = ModifyScores(s, cap, alibi, scale_log2, kept);
  if (alibi.On()) {
#pragma unroll
    for (int half = 0; half < 2; ++half) alibi.Add<false>(s, half, key0 + g + half * 8, r0 + 2 * t);
  }
  if (dense != nullptr) {
    scale_log2 = InLog2Units(s, scale_log2);
#pragma unroll
    for (int half = 0; half < 2; ++half) dense->AddBias<false>(s, half, key0 + g + half * 8, r0 + 2 * t);
  }
#pragma unroll
  for (int nt = 0; nt < kQT; ++nt) {
    const float lse_log2[2] = {lse_at(nt, 0), lse_at(nt, 1)};
#pragma unroll
    for (int i = 0; i < 4; ++i) s[nt][i] = Exp2(s[nt][i] * scale_log2 - lse_log2[i & 1]);
  }
  if (dense != nullptr) {
#pragma unroll
    for (int half = 0; half < 2; ++half) dense->Hide<false>(s, half, key0 + g + half * 8, r0 + 2 * t, 0.f);
  }
  if (full) return;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    // The key sees rows [RowBegin, RowEnd); measured here from r0 + 2t. The
    // key is Unhoisted so its bounds are computed here, on boundary tiles, not
    // held across the caller's walk (they spilled 12 bytes in the
    // three-consumer D 64 kernel).
    const int key = Unhoisted(key0 + g + half * 8);
    ZeroOutside(s, half, pol.RowBegin(key) - r0 - 2 * t, pol.RowEnd(key) - r0 - 2 * t);
    HideOtherSegments<false>(s, half, pol, key, r0, t, 0.f);  // segment_mask.cuh
  }
}

// This lane's LSE of query column nt * 8 + 2t + j in log2 units, from the
// tile's natural-log values in `lse` (kLog2: already in log2 units, as a
// producer that loads them with ordinary instructions stores them, sparing
// each consumer a multiply a value a step).
template <bool kLog2 = false>
__device__ __forceinline__ float KeyMajorLseLog2(const float* lse, int lane, int nt, int j) {
  const float x = lse[nt * 8 + 2 * (lane & 3) + j];
  return kLog2 ? x : x * kLog2e;
}

template <bool kLseLog2 = false, int kQT, typename Kept = NoKeptTanh>
__device__ __forceinline__ void KeyMajorProbs(float (&s)[kQT][4], const MaskPolicy& pol, bool full, int r0,
                                              int key0, const float* lse, int lane, float scale_log2,
                                              SoftCap cap = {}, AlibiBias alibi = {}, Kept&& kept = {},
                                              const DenseTile* dense = nullptr) {
  KeyMajorProbsFrom(
      s, pol, full, r0, key0, [&](int nt, int j) { return KeyMajorLseLog2<kLseLog2>(lse, lane, nt, j); }, lane,
      scale_log2, cap, alibi, kept, dense);
}

// Where a soft-capped backward's pairs lie, for ALiBi's bias in the cap's
// slope (SlopeFromProb reads the capped score back from P, whose exponent
// holds the bias too): the tile's first query row and key, as KeyMajorProbs
// and QueryMajorProbs take them.
struct PairOrigin {
  int r0 = 0, key0 = 0;
};

// dPᵀ -> dSᵀ = Pᵀ ∘ (dPᵀ - delta) in place; delta (and lse, read only under a
// soft-cap, whose slope multiplies dS; in log2 units where kLseLog2) hold the
// tile's values. A KeptTanh (`kept`, filled by KeyMajorProbsFrom) gives the
// cap's slope without lse.
template <bool kLseLog2 = false, int kQT, typename Kept = NoKeptTanh>
__device__ __forceinline__ void KeyMajorDs(const float (&p)[kQT][4], float (&dp)[kQT][4], const float* delta,
                                           int lane, const float* lse = nullptr, SoftCap cap = {},
                                           AlibiBias alibi = {}, PairOrigin at = {}, const Kept& kept = {}) {
  const int t = lane & 3;
  if constexpr (Kept::kOn) {
    if (cap.On()) {
#pragma unroll
      for (int nt = 0; nt < kQT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i)
          dp[nt][i] = p[nt][i] * (dp[nt][i] - delta[nt * 8 + 2 * t + (i & 1)]) * kept.Slope(nt, i, p[nt][i]);
      return;
    }
  }
  if (cap.On()) {
#pragma unroll
    for (int nt = 0; nt < kQT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int q = nt * 8 + 2 * t + (i & 1);
        const float bias = alibi.On() ? alibi.At(at.r0 + q, at.key0 + (lane >> 2) + (i >> 1) * 8) : 0.f;
        const float lse2 = kLseLog2 ? lse[q] : lse[q] * kLog2e;
        dp[nt][i] = p[nt][i] * (dp[nt][i] - delta[q]) * cap.SlopeFromProb(p[nt][i], lse2 - bias);
      }
    return;
  }
#pragma unroll
  for (int nt = 0; nt < kQT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) dp[nt][i] = p[nt][i] * (dp[nt][i] - delta[nt * 8 + 2 * t + (i & 1)]);
}

// ------------------------------------------------------------ query-major element-wise steps
// Per-row statistics of this lane's two rows (row0 + g and row0 + g + 8):
// LSE in log2 units and delta; zeros for rows past q_valid.
struct RowStats {
  float lse_log2[2], delta[2];
  __device__ __forceinline__ void Load(const BwdParams& p, const MaskPolicy& pol, int batch, int head, int row0,
                                       int lane) {
    const AttentionShape& sh = p.shape;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = row0 + (lane >> 2) + half * 8;
      const int64_t idx = (int64_t(batch) * sh.q_heads + head) * sh.q_len + row;
      const bool ok = row < pol.q_valid;
      lse_log2[half] = ok ? p.lse[idx] * kLog2e : 0.f;
      delta[half] = ok ? p.delta[idx] : 0.f;
    }
  }
};

// S -> P in place for this warp's rows from `row0` and key tile
// [c0, c0 + 8 kNT); as KeyMajorProbs, the mask loop runs on boundary tiles only.
template <int kNT>
__device__ __forceinline__ void QueryMajorProbs(float (&s)[kNT][4], const RowStats& rs, const MaskPolicy& pol,
                                                bool full, int row0, int c0, int lane, float scale_log2,
                                                SoftCap cap = {}, AlibiBias alibi = {},
                                                const DenseTile* dense = nullptr) {
  const int g = lane >> 2, t = lane & 3;
  scale_log2 = ModifyScores(s, cap, alibi, scale_log2);
  if (alibi.On()) {
#pragma unroll
    for (int half = 0; half < 2; ++half) alibi.Add<true>(s, half, row0 + g + half * 8, c0 + 2 * t);
  }
  if (dense != nullptr) {
    scale_log2 = InLog2Units(s, scale_log2);
#pragma unroll
    for (int half = 0; half < 2; ++half) dense->AddBias<true>(s, half, row0 + g + half * 8, c0 + 2 * t);
  }
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[nt][i] = Exp2(s[nt][i] * scale_log2 - rs.lse_log2[i >> 1]);
  if (dense != nullptr) {
#pragma unroll
    for (int half = 0; half < 2; ++half) dense->Hide<true>(s, half, row0 + g + half * 8, c0 + 2 * t, 0.f);
  }
  if (full) return;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    // The row sees keys [KeyBegin, KeyEnd) (none past q_valid: an empty
    // range); measured here from c0 + 2t.
    const int row = row0 + g + half * 8;
    const bool real = row < pol.q_valid;
    ZeroOutside(s, half, pol.KeyBegin(row) - c0 - 2 * t, real ? pol.KeyEnd(row) - c0 - 2 * t : 0);
    HideOtherSegments<true>(s, half, pol, row, c0, t, 0.f);  // segment_mask.cuh
  }
}

// dP -> dS = P ∘ (dP - delta) in place.
template <int kNT>
__device__ __forceinline__ void QueryMajorDs(const float (&p)[kNT][4], float (&dp)[kNT][4], const RowStats& rs,
                                             SoftCap cap = {}, AlibiBias alibi = {}, PairOrigin at = {}, int lane = 0) {
  if (cap.On()) {
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float bias = alibi.On() ? alibi.At(at.r0 + (lane >> 2) + (i >> 1) * 8,
                                                 at.key0 + nt * 8 + 2 * (lane & 3) + (i & 1))
                                      : 0.f;
        dp[nt][i] = p[nt][i] * (dp[nt][i] - rs.delta[i >> 1]) *
                    cap.SlopeFromProb(p[nt][i], rs.lse_log2[i >> 1] - bias);
      }
    return;
  }
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) dp[nt][i] = p[nt][i] * (dp[nt][i] - rs.delta[i >> 1]);
}

// ------------------------------------------------------------ epilogues
// A NaN in a row of dQ, dK or dV may be a masked pair's 0 * NaN from a tile
// product (a non-finite value, query, cotangent or delta of a pair the mask
// hides): a lane that finds one among its entries recomputes them exactly
// (exact_rows.cuh) before the store, with no warp collective.

// Writes this warp's 16 rows of dK (times the scale) and dV: keys from `key0`
// of (batch, kv_head), columns [d_base, d_base + 8 kDT). Keys past kv_len are
// not stored; keys no query sees get their zero sums.
template <typename T, int kDT>
__device__ __forceinline__ void StoreKeyGrads(float (&dk)[kDT][4], float (&dv)[kDT][4], const BwdParams& p,
                                              int batch, int kv_head, int key0, int d_base, int lane) {
  const AttentionShape& sh = p.shape;
  const int g = lane >> 2, t = lane & 3;
  const int64_t offset = batch * sh.kv_batch_stride() + kv_head * sh.head_dim + d_base;
  T* gdK = static_cast<T*>(p.dk) + offset;
  T* gdV = static_cast<T*>(p.dv) + offset;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = key0 + g + half * 8;
    if (key >= sh.kv_len) continue;
    if (LaneHasNan(dk, half) || LaneHasNan(dv, half)) {
      ExactKeyGradLane<T>(p, batch, kv_head, key, t, half, dk, d_base, dv, d_base);
    }
    const int64_t row = key * sh.kv_row_stride();
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      const int col = dt * 8 + 2 * t;
      if (d_base + col < sh.head_dim) {
        *reinterpret_cast<uint32_t*>(gdK + row + col) =
            ElemTraits<T>::Pack(dk[dt][2 * half] * p.scale, dk[dt][2 * half + 1] * p.scale);
        *reinterpret_cast<uint32_t*>(gdV + row + col) = ElemTraits<T>::Pack(dv[dt][2 * half], dv[dt][2 * half + 1]);
      }
    }
  }
}

// Writes this warp's 16 rows of dQ (times the scale) from `row0` of
// (batch, head); rows past q_valid (padding queries) get zeros.
template <typename T, int kDT>
__device__ __forceinline__ void StoreQueryGrad(float (&dq)[kDT][4], const BwdParams& p, const MaskPolicy& pol,
                                               int batch, int head, int row0, int lane) {
  const AttentionShape& sh = p.shape;
  const int g = lane >> 2, t = lane & 3;
  T* gdQ = static_cast<T*>(p.dq) + batch * sh.q_batch_stride() + head * sh.head_dim;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = row0 + g + half * 8;
    if (row >= sh.q_len) continue;
    const bool real = row < pol.q_valid;
    if (real && LaneHasNan(dq, half)) ExactQueryGradLane<T>(p, batch, head, row, t, dq, half);
    T* dst = gdQ + row * sh.q_row_stride();
#pragma unroll
    for (int dt = 0; dt < kDT; ++dt) {
      const int col = dt * 8 + 2 * t;
      if (col < sh.head_dim) {
        *reinterpret_cast<uint32_t*>(dst + col) =
            real ? ElemTraits<T>::Pack(dq[dt][2 * half] * p.scale, dq[dt][2 * half + 1] * p.scale) : 0u;
      }
    }
  }
}

// ------------------------------------------------------------ the fused backward
// One pass: the dK/dV kernel also adds each query tile's dS·K into the
// float32 sums p.dq_accum (zeroed by the delta kernel), and DqFromSumsKernel
// then writes dQ from them through StoreQueryGrad: the scale, zeros for
// padding rows, and the exact recomputation of a row that a masked pair's
// 0 * NaN reached. The order of the additions varies run to run, so
// deterministic calls keep the two-kernel backward.

// Whether a test or the tuner forced a tile candidate (a cached preferred
// tile does not count).
inline bool TileForced(const BwdParams& p) {
  return p.tile % FwdParams::kTileSm80 > 0 && !(p.tile & FwdParams::kTilePreferred);
}
// Whether a family with a fused backward runs it: the caller gave room for
// the sums, the call has queries, wants no bit-reproducibility, and forces no
// candidate of the two-kernel table (the tile tests and the tuner do).
inline bool UseFusedBackward(const BwdParams& p) {
  return p.dq_accum != nullptr && !p.deterministic && p.shape.q_len > 0 && !TileForced(p);
}

// Adds this warp's share of a 64 x 8 kCT dQ block (the wgmma accumulator
// layout, rows from `row0`, columns from `col0`, before the scale) into the
// sums of (batch, head); rows past q_valid and columns past head_dim are left.
// Each of a lane's two rows is one pointer and its kCT float pairs fixed
// offsets from it: built per reduction, the 64-bit address took ~16
// instructions and rewrote the registers the previous reduction was still to
// read, so every reduction waited for the one before to leave (54% of the
// D 256 pass's warp samples, docs/performance.md, twenty-sixth session). A
// warp whose 16 rows and 8 kCT columns are all in place (every one but a
// ragged tail's) issues its reductions without a condition. (The two loops
// are written out: one loop body behind a compile-time `checked` flag spilled
// 8 bytes in the D 256 fused pass.)
template <int kCT>
__device__ __forceinline__ void AddQueryGradSums(const float (&dq)[kCT][4], const BwdParams& p, int q_valid,
                                                 int batch, int head, int row0, int col0, int lane) {
  const AttentionShape& sh = p.shape;
  const int g = lane >> 2, t = lane & 3;
  const int64_t stride = sh.q_row_stride();
  float* const row_g = p.dq_accum + batch * sh.q_batch_stride() + head * sh.head_dim + col0 + 2 * t +
                       (row0 + g) * stride;
  auto add = [&](float* at, float x, float y) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(at), "f"(x), "f"(y) : "memory");
  };
  if (row0 + 16 <= q_valid && sh.head_dim - col0 >= 8 * kCT) {
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int ct = 0; ct < kCT; ++ct) add(row_g + half * 8 * stride + ct * 8, dq[ct][2 * half], dq[ct][2 * half + 1]);
    return;
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (row0 + g + half * 8 >= q_valid) continue;
#pragma unroll
    for (int ct = 0; ct < kCT; ++ct) {
      if (col0 + ct * 8 + 2 * t < sh.head_dim) add(row_g + half * 8 * stride + ct * 8, dq[ct][2 * half], dq[ct][2 * half + 1]);
    }
  }
}

// Columns [c, c + 8) of a dQ row's float32 sums (two 16-byte loads), and
// whether any of them is NaN.
__device__ __forceinline__ void LoadQueryGradSums(const BwdParams& p, int64_t off, int c, float (&v)[8]) {
  *reinterpret_cast<float4*>(&v[0]) = *reinterpret_cast<const float4*>(p.dq_accum + off + c);
  *reinterpret_cast<float4*>(&v[4]) = *reinterpret_cast<const float4*>(p.dq_accum + off + c + 4);
}
__device__ __forceinline__ bool AnyNan(const float (&v)[8]) {
  bool nan = false;
#pragma unroll
  for (int i = 0; i < 8; ++i) nan |= isnan(v[i]);
  return nan;
}

// Columns [c, c + 8) of a dQ row from their sums: scaled, or zeros for a
// padding row.
template <typename T>
__device__ __forceinline__ void StoreQueryGradChunk(const BwdParams& p, const RowPassThread& r, int c,
                                                    const float (&v)[8], bool padding) {
  uint4 out = make_uint4(0, 0, 0, 0);
  if (!padding) {
    out.x = ElemTraits<T>::Pack(v[0] * p.scale, v[1] * p.scale);
    out.y = ElemTraits<T>::Pack(v[2] * p.scale, v[3] * p.scale);
    out.z = ElemTraits<T>::Pack(v[4] * p.scale, v[5] * p.scale);
    out.w = ElemTraits<T>::Pack(v[6] * p.scale, v[7] * p.scale);
  }
  *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + r.off + c) = out;
}

// dQ from the sums, a row-wise pass: the scale, zeros for padding rows, and
// the exact recomputation of entries that a masked pair's 0 * NaN reached.
template <typename T>
__global__ void __launch_bounds__(kRowPassThreads) DqFromSumsKernel(const BwdParams p) {
  const AttentionShape& sh = p.shape;
  RowPassThread::ForEach<kQueryGradRows>(sh, [&](const RowPassThread (&rows)[kQueryGradRows]) {
    const int lane = rows[0].lane_in_row, lanes = rows[0].lanes;
    const int q_valid = MaskPolicy::ForBatch(p, rows[0].batch).q_valid;
    unsigned nan_rows = 0;  // bit j: row j is real, not padding, and a sum of its is NaN
    for (int c = lane * 8; c < sh.head_dim; c += lanes * 8) {
      float v[kQueryGradRows][8];
#pragma unroll
      for (int j = 0; j < kQueryGradRows; ++j) {
        if (rows[j].real) LoadQueryGradSums(p, rows[j].off, c, v[j]);
      }
#pragma unroll
      for (int j = 0; j < kQueryGradRows; ++j) {
        if (!rows[j].real) continue;
        const bool padding = rows[j].t >= q_valid;
        if (AnyNan(v[j]) && !padding) nan_rows |= 1u << j;
        StoreQueryGradChunk<T>(p, rows[j], c, v[j], padding);
      }
    }
    // Rare: those rows' chunks again, one row at a time after the common
    // path. (Inlined into it, four copies of the recomputation took 206
    // registers; here, 128 and two CTAs an SM, each thread with 128 bytes of
    // loads in flight where the one-row pass had three CTAs of 32.)
#pragma unroll 1
    for (int j = 0; nan_rows != 0 && j < kQueryGradRows; ++j) {
      if (!(nan_rows >> j & 1u)) continue;
      const RowPassThread r = RowPassThread::At<kQueryGradRows>(sh, rows[0].batch, j);
      for (int c = lane * 8; c < sh.head_dim; c += lanes * 8) {
        float w[8];
        LoadQueryGradSums(p, r.off, c, w);
        if (!AnyNan(w)) continue;
        ExactQueryGradColumns<T>(p, r.batch, r.h, r.t, c, w);
        StoreQueryGradChunk<T>(p, r, c, w, false);
      }
    }
  });
}

// The fused backward around its one pass: delta (zeroing the sums), `pass`
// (the dK/dV kernel with dQ sums; called when there are keys), then dQ from
// the sums. The dispatch sends calls
// without queries to the two-kernel backward.
template <typename T, int kD, typename Pass>
Status RunFusedBackward(const BwdParams& p, cudaStream_t stream, Pass&& pass) {
  const AttentionShape& sh = p.shape;
  if (sh.batch == 0 || sh.q_heads == 0 || sh.q_len == 0) return Status::Ok();
  Status st = LaunchDelta<T>(p, stream);
  if (!st.ok()) return st;
  if (sh.kv_len > 0 && !(st = pass()).ok()) return st;
  DqFromSumsKernel<T><<<RowPassGrid<kQueryGradRows>(sh), kRowPassThreads, 0, stream>>>(p);
  return CheckLaunch("attention backward (dQ from its sums)");
}

}  // namespace tc
}  // namespace jaxflash
