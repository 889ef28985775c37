// SIMT attention: one warp per query row (forward, dQ) or per key (dK/dV),
// tiles of 32 keys or 32 query rows staged in shared memory as fp32.
//
// Lane j of a warp owns element j of a 32-wide tile (a key, or a query row),
// so each score is one lane's private dot product over head_dim: no shuffles
// in the inner product. Staged rows use an odd stride, so the 32 lanes walking
// 32 different rows hit 32 different banks. Accumulators are split over lanes
// by head_dim (element lane + 32 * e). No atomics anywhere: the backward is
// deterministic by construction. The accumulations skip the pairs the mask
// hides (a warp-uniform test), so a NaN or Inf of a key or row that a row
// or key cannot see never reaches it through a zero weight.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <mutex>
#include <string>

#include "common/alibi.h"
#include "common/mask.h"
#include "common/mma.cuh"
#include "common/score_mod.cuh"
#include "simt/simt.h"

namespace jaxflash {
namespace {

constexpr int kWarp = 32;
constexpr int kWarps = 8;                // warps per block
constexpr int kThreads = kWarp * kWarps;
constexpr int kTile = 32;                // keys (or rows) staged per step
constexpr int kSlices = 256 / kWarp;     // head_dim elements per lane, at most
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T> __device__ __forceinline__ float ToFloat(T x);
template <> __device__ __forceinline__ float ToFloat(float x) { return x; }
template <> __device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T FromFloat(float x);
template <> __device__ __forceinline__ float FromFloat(float x) { return x; }
template <> __device__ __forceinline__ __half FromFloat(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 FromFloat(float x) { return __float2bfloat16_rn(x); }

using tc::MaxNaN;
using tc::WarpSum;

__device__ __forceinline__ float WarpMax(float x) {
  for (int o = 16; o > 0; o >>= 1) x = MaxNaN(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Bit j: lane j's pair is visible (the lanes of a warp hold 32 keys or rows).
__device__ __forceinline__ unsigned VisibleLanes(bool visible) { return __ballot_sync(0xffffffffu, visible); }
__device__ __forceinline__ bool Bit(unsigned bits, int j) { return (bits >> j) & 1u; }

// Odd row stride of staged tiles: conflict-free when lanes walk different rows.
__host__ __device__ __forceinline__ int StagedStride(int dim) { return dim | 1; }

__device__ __forceinline__ float Dot(const float* a, const float* b, int dim) {
  float s = 0.f;
  for (int d = 0; d < dim; ++d) s = fmaf(a[d], b[d], s);
  return s;
}

// Copies `count` rows (`row_stride` apart in global memory, starting at
// `src`) into dst[kTile][stride] as fp32 * multiplier; rows >= count are zero.
template <typename T>
__device__ void StageRows(const T* src, int64_t row_stride, int count, int dim, int stride,
                          float multiplier, float* dst) {
  for (int idx = threadIdx.x; idx < kTile * dim; idx += kThreads) {
    const int r = idx / dim, d = idx - r * dim;
    dst[r * stride + d] = r < count ? ToFloat(src[r * row_stride + d]) * multiplier : 0.f;
  }
}

// Keys [c0, c0 + count) of K/V head kv_head into dst[kTile][stride] as fp32
// (rows >= count zero), each row found through PagedKv::Row: the forward's
// staging, which reads a dense or a paged cache alike.
template <typename T>
__device__ void StageKeys(const FwdParams& p, const T* base, int b, int kv_head, int c0, int count,
                          int stride, float* dst) {
  const int dim = static_cast<int>(p.shape.head_dim);
  for (int idx = threadIdx.x; idx < kTile * dim; idx += kThreads) {
    const int r = idx / dim, d = idx - r * dim;
    const int64_t row = r < count ? p.paged.Row(b, p.shape.kv_len, c0 + r) : 0;
    dst[r * stride + d] =
        r < count ? ToFloat(base[row * p.shape.kv_row_stride() + int64_t(kv_head) * dim + d]) : 0.f;
  }
}

// One row of `dim` elements into dst[dim], by one warp.
template <typename T>
__device__ void WarpLoadRow(const T* src, int dim, float multiplier, float* dst) {
  for (int d = threadIdx.x % kWarp; d < dim; d += kWarp) dst[d] = ToFloat(src[d]) * multiplier;
}

struct Geometry {
  AttentionShape s;
  __device__ int64_t Q(int b, int h, int row) const {
    return b * s.q_batch_stride() + row * s.q_row_stride() + int64_t(h) * s.head_dim;
  }
  __device__ int64_t Kv(int b, int h, int col) const {
    return b * s.kv_batch_stride() + col * s.kv_row_stride() + int64_t(h) * s.head_dim;
  }
  __device__ int64_t Stat(int b, int h, int row) const { return (int64_t(b) * s.q_heads + h) * s.q_len + row; }
};

// ------------------------------------------------------------------ forward
// grid (row blocks of kWarps rows, batch * q_heads); warp w owns one row.
template <typename T>
__global__ void __launch_bounds__(kThreads, 2) ForwardKernel(FwdParams p) {
  const tc::SoftCap cap = tc::SoftCap::Of(p);  // score_mod.cuh
  extern __shared__ float smem[];
  const int dim = p.shape.head_dim, stride = StagedStride(dim);
  float* ks = smem;
  float* vs = ks + kTile * stride;
  float* qs = vs + kTile * stride;  // [kWarps][dim]
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.y / p.shape.q_heads, h = blockIdx.y % p.shape.q_heads;
  const int kv_head = h / p.shape.group_size();
  const int r0 = blockIdx.x * kWarps, row = r0 + warp;
  const Geometry g{p.shape};
  const MaskPolicy mask = MaskPolicy::For(p.mask, p.shape.q_len, p.shape.kv_len, p.q_lengths,
                                          p.kv_lengths, b);
  const Alibi alibi = Alibi::Of(p.alibi, b, h, p.shape.q_heads);  // common/alibi.h
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  const int rows_valid = min(kWarps, mask.q_valid - r0);
  const int key_begin = rows_valid > 0 ? mask.BlockKeyBegin(r0) : 0;
  const int key_end = rows_valid > 0 ? mask.BlockKeyEnd(r0 + rows_valid - 1) : 0;
  const bool live = row < mask.q_valid;
  if (live) WarpLoadRow(q + g.Q(b, h, row), dim, p.scale * kLog2e, qs + warp * dim);

  float acc[kSlices] = {};
  float row_max = -INFINITY, row_sum = 0.f;
  for (int c0 = key_begin; c0 < key_end; c0 += kTile) {
    const int cols = min(kTile, key_end - c0);
    __syncthreads();  // the previous tile is consumed (and qs is written)
    StageKeys(p, k, b, kv_head, c0, cols, stride, ks);
    StageKeys(p, v, b, kv_head, c0, cols, stride, vs);
    __syncthreads();
    if (!live) continue;
    const int key = c0 + lane;
    const unsigned vis = VisibleLanes(lane < cols && mask.Visible(row, key));
    float s = -INFINITY, th;
    if (Bit(vis, lane)) {
      s = Dot(qs + warp * dim, ks + lane * stride, dim);
      if (cap.On()) s = cap.ApplyExact(s, &th);
      s += alibi.Bias(Alibi::Diagonal(mask, row), static_cast<float>(key));  // (0 without slopes)
    }
    const float new_max = MaxNaN(row_max, WarpMax(s));
    if (new_max == -INFINITY) continue;  // warp-uniform
    const float rescale = exp2f(row_max - new_max);
    const float prob = exp2f(s - new_max);
    row_sum = row_sum * rescale + WarpSum(prob);
    row_max = new_max;
#pragma unroll
    for (int e = 0; e < kSlices; ++e) acc[e] *= rescale;
    for (int j = 0; j < cols; ++j) {
      if (!Bit(vis, j)) continue;  // warp-uniform
      const float pj = __shfl_sync(0xffffffffu, prob, j);
#pragma unroll
      for (int e = 0; e < kSlices; ++e) {
        const int d = lane + kWarp * e;
        if (d < dim) acc[e] = fmaf(pj, vs[j * stride + d], acc[e]);
      }
    }
  }
  if (row >= p.shape.q_len) return;
  // As a dense softmax: visible scores all -inf give 0 / 0 = NaN, a +inf or
  // NaN score a NaN row and LSE; rows that see no key are zero.
  const bool keys = mask.HasKeys(row);
  const float inv = 1.f / row_sum;
  T* o = static_cast<T*>(p.o) + g.Q(b, h, row);
#pragma unroll
  for (int e = 0; e < kSlices; ++e) {
    const int d = lane + kWarp * e;
    if (d < dim) o[d] = FromFloat<T>(keys ? acc[e] * inv : 0.f);
  }
  if (lane == 0) p.lse[g.Stat(b, h, row)] = keys ? (row_max + log2f(row_sum)) * kLn2 : kEmptyRowLse;
}

// ------------------------------------------------------------------ backward
// delta = rowsum(dO * O) - dLSE; one warp per row.
template <typename T>
__global__ void __launch_bounds__(kThreads, 2) DeltaKernel(BwdParams p, float* delta) {
  const int64_t rows = p.shape.batch * p.shape.q_heads * p.shape.q_len;
  const int64_t stat = int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarp;
  if (stat >= rows) return;
  const int row = stat % p.shape.q_len;
  const int h = (stat / p.shape.q_len) % p.shape.q_heads;
  const int b = stat / (p.shape.q_len * p.shape.q_heads);
  const int64_t off = Geometry{p.shape}.Q(b, h, row);
  const T* o = static_cast<const T*>(p.o) + off;
  const T* dout = static_cast<const T*>(p.dout) + off;
  float sum = 0.f;
  for (int d = threadIdx.x % kWarp; d < p.shape.head_dim; d += kWarp) {
    sum = fmaf(ToFloat(o[d]), ToFloat(dout[d]), sum);
  }
  sum = WarpSum(sum);
  // 0 for a row that sees no key: its dO (padding, say) reaches no key.
  const bool keys = MaskPolicy::ForBatch(p, b).HasKeys(row);
  if (threadIdx.x % kWarp == 0) delta[stat] = keys ? sum - p.dlse[stat] : 0.f;
}

// dQ: grid (row blocks, batch * q_heads); warp w owns one query row, lane j
// one key of the staged tile.
template <typename T>
__global__ void __launch_bounds__(kThreads, 2) QueryGradKernel(BwdParams p, const float* delta) {
  const tc::SoftCap cap = tc::SoftCap::Of(p);  // score_mod.cuh
  extern __shared__ float smem[];
  const int dim = p.shape.head_dim, stride = StagedStride(dim);
  float* ks = smem;
  float* vs = ks + kTile * stride;
  float* qs = vs + kTile * stride;   // [kWarps][dim], scaled by scale * log2(e)
  float* dos = qs + kWarps * dim;    // [kWarps][dim]
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.y / p.shape.q_heads, h = blockIdx.y % p.shape.q_heads;
  const int kv_head = h / p.shape.group_size();
  const int r0 = blockIdx.x * kWarps, row = r0 + warp;
  const Geometry g{p.shape};
  const MaskPolicy mask = MaskPolicy::For(p.mask, p.shape.q_len, p.shape.kv_len, p.q_lengths,
                                          p.kv_lengths, b);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);

  const int rows_valid = min(kWarps, mask.q_valid - r0);
  const int key_begin = rows_valid > 0 ? mask.BlockKeyBegin(r0) : 0;
  const int key_end = rows_valid > 0 ? mask.BlockKeyEnd(r0 + rows_valid - 1) : 0;
  const bool live = row < mask.q_valid;
  float lse2 = 0.f, row_delta = 0.f;
  if (live) {
    WarpLoadRow(static_cast<const T*>(p.q) + g.Q(b, h, row), dim, p.scale * kLog2e, qs + warp * dim);
    WarpLoadRow(static_cast<const T*>(p.dout) + g.Q(b, h, row), dim, 1.f, dos + warp * dim);
    lse2 = p.lse[g.Stat(b, h, row)] * kLog2e;
    row_delta = delta[g.Stat(b, h, row)];
  }
  float acc[kSlices] = {};
  for (int c0 = key_begin; c0 < key_end; c0 += kTile) {
    const int cols = min(kTile, key_end - c0);
    __syncthreads();
    StageRows(k + g.Kv(b, kv_head, c0), p.shape.kv_row_stride(), cols, dim, stride, 1.f, ks);
    StageRows(v + g.Kv(b, kv_head, c0), p.shape.kv_row_stride(), cols, dim, stride, 1.f, vs);
    __syncthreads();
    if (!live) continue;
    const unsigned vis = VisibleLanes(lane < cols && mask.Visible(row, c0 + lane));
    float ds = 0.f;
    if (Bit(vis, lane)) {
      float score = Dot(qs + warp * dim, ks + lane * stride, dim), th = 0.f;
      if (cap.On()) score = cap.ApplyExact(score, &th);
      score += Alibi::Of(p.alibi, b, h, p.shape.q_heads).Bias(Alibi::Diagonal(mask, row), float(c0 + lane));
      const float prob = exp2f(score - lse2);
      ds = prob * (Dot(dos + warp * dim, vs + lane * stride, dim) - row_delta) * (1.f - th * th);
    }
    for (int j = 0; j < cols; ++j) {
      if (!Bit(vis, j)) continue;  // warp-uniform
      const float dsj = __shfl_sync(0xffffffffu, ds, j);
#pragma unroll
      for (int e = 0; e < kSlices; ++e) {
        const int d = lane + kWarp * e;
        if (d < dim) acc[e] = fmaf(dsj, ks[j * stride + d], acc[e]);
      }
    }
  }
  if (row >= p.shape.q_len) return;
  T* dq = static_cast<T*>(p.dq) + g.Q(b, h, row);
#pragma unroll
  for (int e = 0; e < kSlices; ++e) {
    const int d = lane + kWarp * e;
    if (d < dim) dq[d] = FromFloat<T>(acc[e] * p.scale);
  }
}

// dK, dV: grid (key blocks of kWarps keys, batch * kv_heads); warp w owns one
// key, lane r one query row of the staged tile; walks every query head of the
// GQA group and every row that sees the block's keys.
template <typename T>
__global__ void __launch_bounds__(kThreads, 2) KeyValueGradKernel(BwdParams p, const float* delta) {
  const tc::SoftCap cap = tc::SoftCap::Of(p);  // score_mod.cuh
  extern __shared__ float smem[];
  const int dim = p.shape.head_dim, stride = StagedStride(dim);
  float* qs = smem;                  // [kTile][stride], scaled by scale * log2(e)
  float* dos = qs + kTile * stride;  // [kTile][stride]
  float* ks = dos + kTile * stride;  // [kWarps][dim]
  float* vs = ks + kWarps * dim;     // [kWarps][dim]
  float* lse2 = vs + kWarps * dim;   // [kTile]
  float* deltas = lse2 + kTile;      // [kTile]
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int b = blockIdx.y / p.shape.kv_heads, kv_head = blockIdx.y % p.shape.kv_heads;
  const int c0 = blockIdx.x * kWarps, key = c0 + warp;
  const Geometry g{p.shape};
  const MaskPolicy mask = MaskPolicy::For(p.mask, p.shape.q_len, p.shape.kv_len, p.q_lengths,
                                          p.kv_lengths, b);
  const int keys_valid = min(kWarps, mask.kv_valid - c0);
  const int row_begin = keys_valid > 0 ? mask.BlockRowBegin(c0) : 0;
  const int row_end = keys_valid > 0 ? mask.BlockRowEnd(c0 + keys_valid - 1) : 0;
  const bool live = key < mask.kv_valid;
  if (live) {
    WarpLoadRow(static_cast<const T*>(p.k) + g.Kv(b, kv_head, key), dim, 1.f, ks + warp * dim);
    WarpLoadRow(static_cast<const T*>(p.v) + g.Kv(b, kv_head, key), dim, 1.f, vs + warp * dim);
  }
  float dk[kSlices] = {}, dv[kSlices] = {};
  const int group = p.shape.group_size();
  for (int h = kv_head * group; h < (kv_head + 1) * group; ++h) {
    for (int i0 = row_begin; i0 < row_end; i0 += kTile) {
      const int rows = min(kTile, row_end - i0);
      __syncthreads();
      StageRows(static_cast<const T*>(p.q) + g.Q(b, h, i0), p.shape.q_row_stride(), rows, dim,
                stride, p.scale * kLog2e, qs);
      StageRows(static_cast<const T*>(p.dout) + g.Q(b, h, i0), p.shape.q_row_stride(), rows, dim,
                stride, 1.f, dos);
      if (threadIdx.x < rows) {
        lse2[threadIdx.x] = p.lse[g.Stat(b, h, i0 + threadIdx.x)] * kLog2e;
        deltas[threadIdx.x] = delta[g.Stat(b, h, i0 + threadIdx.x)];
      }
      __syncthreads();
      if (!live) continue;
      const unsigned vis = VisibleLanes(lane < rows && mask.Visible(i0 + lane, key));
      float prob = 0.f, ds = 0.f;
      if (Bit(vis, lane)) {
        float score = Dot(qs + lane * stride, ks + warp * dim, dim), th = 0.f;
        if (cap.On()) score = cap.ApplyExact(score, &th);
        score += Alibi::Of(p.alibi, b, h, p.shape.q_heads).Bias(Alibi::Diagonal(mask, i0 + lane), float(key));
        prob = exp2f(score - lse2[lane]);
        ds = prob * (Dot(dos + lane * stride, vs + warp * dim, dim) - deltas[lane]) * (1.f - th * th);
      }
      for (int r = 0; r < rows; ++r) {
        if (!Bit(vis, r)) continue;  // warp-uniform
        const float pr = __shfl_sync(0xffffffffu, prob, r);
        const float dsr = __shfl_sync(0xffffffffu, ds, r);
#pragma unroll
        for (int e = 0; e < kSlices; ++e) {
          const int d = lane + kWarp * e;
          if (d < dim) {
            dv[e] = fmaf(pr, dos[r * stride + d], dv[e]);
            dk[e] = fmaf(dsr, qs[r * stride + d], dk[e]);
          }
        }
      }
    }
  }
  if (key >= p.shape.kv_len) return;
  const int64_t off = g.Kv(b, kv_head, key);
  T* dk_out = static_cast<T*>(p.dk) + off;
  T* dv_out = static_cast<T*>(p.dv) + off;
#pragma unroll
  for (int e = 0; e < kSlices; ++e) {
    const int d = lane + kWarp * e;
    // qs carries scale * log2(e); ln 2 turns it back into scale.
    if (d < dim) {
      dk_out[d] = FromFloat<T>(dk[e] * kLn2);
      dv_out[d] = FromFloat<T>(dv[e]);
    }
  }
}

// ------------------------------------------------------------------ launchers

size_t ForwardSmem(int dim) { return sizeof(float) * (2 * kTile * StagedStride(dim) + kWarps * dim); }
size_t QueryGradSmem(int dim) {
  return sizeof(float) * (2 * kTile * StagedStride(dim) + 2 * kWarps * dim);
}
size_t KeyValueGradSmem(int dim) {
  return sizeof(float) * (2 * kTile * StagedStride(dim) + 2 * kWarps * dim + 2 * kTile);
}

// Raises a kernel's dynamic shared memory limit to what the largest head_dim
// needs, once per kernel. The kernel is a template argument, not a parameter:
// kernels of one signature share a function-pointer type, and a flag keyed on
// the type would opt in only the first of them.
template <auto kKernel>
Status OptInSmem(size_t bytes) {
  static std::once_flag once;
  static cudaError_t result = cudaSuccess;
  std::call_once(once, [&] {
    result = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes));
  });
  if (result != cudaSuccess) {
    return Status::Internal(std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(result));
  }
  return Status::Ok();
}

Status LastLaunchError(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string(what) + " launch failed: " + cudaGetErrorString(e));
}

Status CheckGrid(int64_t blocks_x, int64_t blocks_y) {
  if (blocks_x >= (int64_t{1} << 31) || blocks_y > 65535) {
    return Status::Unimplemented("problem too large for the SIMT kernels' grid (batch * heads must be <= 65535)");
  }
  return Status::Ok();
}

template <typename T>
Status Forward(const FwdParams& p, cudaStream_t stream) {
  const int dim = p.shape.head_dim;
  const int64_t bx = (p.shape.q_len + kWarps - 1) / kWarps, by = p.shape.batch * p.shape.q_heads;
  if (auto s = CheckGrid(bx, by); !s.ok()) return s;
  if (auto s = OptInSmem<ForwardKernel<T>>(ForwardSmem(256)); !s.ok()) return s;
  ForwardKernel<T><<<dim3(bx, by), kThreads, ForwardSmem(dim), stream>>>(p);
  return LastLaunchError("SIMT forward");
}

template <typename T>
Status Backward(const BwdParams& p, float* delta, cudaStream_t stream) {
  const int dim = p.shape.head_dim;
  const int64_t rows = p.shape.batch * p.shape.q_heads * p.shape.q_len;
  const int64_t qx = (p.shape.q_len + kWarps - 1) / kWarps, qy = p.shape.batch * p.shape.q_heads;
  const int64_t kx = (p.shape.kv_len + kWarps - 1) / kWarps, ky = p.shape.batch * p.shape.kv_heads;
  if (auto s = CheckGrid(qx, qy); !s.ok()) return s;
  if (auto s = CheckGrid((rows + kWarps - 1) / kWarps, 1); !s.ok()) return s;
  if (auto s = OptInSmem<QueryGradKernel<T>>(QueryGradSmem(256)); !s.ok()) return s;
  if (auto s = OptInSmem<KeyValueGradKernel<T>>(KeyValueGradSmem(256)); !s.ok()) return s;
  DeltaKernel<T><<<(rows + kWarps - 1) / kWarps, kThreads, 0, stream>>>(p, delta);
  if (auto s = LastLaunchError("SIMT delta"); !s.ok()) return s;
  QueryGradKernel<T><<<dim3(qx, qy), kThreads, QueryGradSmem(dim), stream>>>(p, delta);
  if (auto s = LastLaunchError("SIMT dQ"); !s.ok()) return s;
  KeyValueGradKernel<T><<<dim3(kx, ky), kThreads, KeyValueGradSmem(dim), stream>>>(p, delta);
  return LastLaunchError("SIMT dK/dV");
}

}  // namespace

Status SimtAttentionForward(const FwdParams& p, cudaStream_t stream) {
  switch (p.dtype) {
    case DType::kFloat32: return Forward<float>(p, stream);
    case DType::kFloat16: return Forward<__half>(p, stream);
    case DType::kBFloat16: return Forward<__nv_bfloat16>(p, stream);
  }
  return Status::Unimplemented("SIMT forward: unknown dtype");
}

size_t SimtBackwardWorkspaceBytes(const BwdParams& p) {
  return sizeof(float) * p.shape.batch * p.shape.q_heads * p.shape.q_len;
}

Status SimtAttentionBackward(const BwdParams& p, void* workspace, cudaStream_t stream) {
  float* delta = static_cast<float*>(workspace);
  switch (p.dtype) {
    case DType::kFloat32: return Backward<float>(p, delta, stream);
    case DType::kFloat16: return Backward<__half>(p, delta, stream);
    case DType::kBFloat16: return Backward<__nv_bfloat16>(p, delta, stream);
  }
  return Status::Unimplemented("SIMT backward: unknown dtype");
}

}  // namespace jaxflash
