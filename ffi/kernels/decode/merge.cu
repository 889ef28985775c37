// The merge pass of split-KV: combines the per-split normalised outputs and
// base-2 LSEs (FwdParams::o_partial, lse_partial) into O and the natural-log
// LSE by the rule in common/decode.h (SplitMerge, shared with the CPU).
//
// The merge is a few rows of many splits (a q_len 1 step: one row per query
// head, up to 64 splits), so it is latency that counts, not bytes: a warp per
// row walking 32 splits took 9.8 us for B 1, 32 heads on an H100 (four CTAs,
// five dependent rounds of loads), 5% of the decode step it merged. Here up to
// eight warps share a row (WarpsPerRow): every warp folds the row's split LSEs
// (side by side over the lanes, joined by shuffles) into the rule's max and
// sum, then takes every n-th split of the row's n warps with all its loads in
// flight together, each lane owning 4 columns; the warps' partial sums meet in
// shared memory and the row's first warp adds them in warp order (the same
// order every run).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "common/launch_util.cuh"
#include "common/mma.cuh"
#include "decode/launch_decode.h"

namespace jaxflash {
namespace decode {
namespace {

constexpr int kWarps = 8;  // per block
constexpr int kBatch = 8;  // splits whose loads a lane has in flight together

// Warps that share a row: enough for one round of loads per lane where
// possible, a power of two so that rows fill a block exactly.
inline int WarpsPerRow(int splits) {
  int w = 1;
  while (w < kWarps && w * kBatch < splits) w *= 2;
  return w;
}

// The minimum of one block a multiprocessor: without it ptxas aimed at full
// occupancy, capped the kernel at 40 registers and spilled.
template <typename T>
__global__ void __launch_bounds__(32 * kWarps, 1) MergeSplitsKernel(const FwdParams p, int warps_per_row) {
  __shared__ float4 partial[kWarps][32];
  const AttentionShape& sh = p.shape;
  const int64_t per_batch = sh.q_len * sh.q_heads;  // rows (query row, head) of one batch element
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int part = warp % warps_per_row;  // this warp's place among its row's
  const int64_t row = int64_t(blockIdx.x) * (kWarps / warps_per_row) + warp / warps_per_row;
  const bool real = row < sh.batch * per_batch;  // a block's last rows may be past the end (no early
                                                 // return: the block meets at __syncthreads)
  const int64_t batch = real ? row / per_batch : 0, within = real ? row % per_batch : 0;
  const int splits = p.num_splits;
  const int v_dim = static_cast<int>(sh.v_dim());  // o and its partials take the value's head dim
  // Split s of this row: lse at lse_s[s * per_batch], output at o_s[s * per_batch * v_dim].
  const float* lse_s = p.lse_partial + batch * splits * per_batch + within;
  const float* o_s = p.o_partial + (batch * splits * per_batch + within) * v_dim;

  // The rule of common/decode.h: splits that saw no key of the row are
  // skipped, a row no split saw gets O = 0 and kEmptyRowLse, a NaN split LSE
  // makes the row NaN, and all -inf splits give 0 / 0 = NaN.
  const auto lse = [&](int s) { return real && s < splits ? lse_s[int64_t(s) * per_batch] : kEmptyRowLse; };
  constexpr unsigned kAll = 0xffffffffu;
  SplitMerge merge = SplitMerge::None();
  for (int s = lane; s < splits; s += 32) merge.Add(lse(s));
  for (int off = 16; off > 0; off >>= 1) {
    merge.Join({__shfl_xor_sync(kAll, static_cast<int>(merge.seen), off) != 0,
                __shfl_xor_sync(kAll, merge.shift, off)});
  }
  merge.Finish();
  const auto exp2 = [](float x) { return tc::Exp2(x); };
  float sum = 0.f;
  for (int s = lane; s < splits; s += 32) sum += merge.Weight(lse(s), exp2);
  for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(kAll, sum, off);
  const float inv = merge.seen ? 1.f / sum : 0.f;
  if (real && part == 0 && lane == 0) {
    const int64_t head = within % sh.q_heads, q_row = within / sh.q_heads;
    p.lse[(batch * sh.q_heads + head) * sh.q_len + q_row] =
        merge.seen ? (merge.shift + __log2f(sum)) * 0.6931471805599453f : kEmptyRowLse;
  }
  // Every split stored all its rows (zeros where it saw no key), so every load
  // below reads written memory; a skipped split's value is loaded, then unused.
  T* out = static_cast<T*>(p.o) + row * v_dim;
  for (int d0 = 0; d0 < v_dim; d0 += 32 * 4) {  // the same trip count on every thread (__syncthreads)
    const int d = d0 + lane * 4;
    const bool mine = real && d < v_dim;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = part; merge.seen && s0 < splits; s0 += warps_per_row * kBatch) {
      float x[kBatch];
      float4 v[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {  // every load issued before any is used
        const int s = s0 + u * warps_per_row;
        x[u] = lse(s);
        v[u] = mine && s < splits ? *reinterpret_cast<const float4*>(o_s + int64_t(s) * per_batch * v_dim + d)
                                  : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (x[u] == kEmptyRowLse) continue;  // no split, or one skipped (not multiplied by 0)
        const float w = merge.Weight(x[u], exp2) * inv;
        acc.x += w * v[u].x;
        acc.y += w * v[u].y;
        acc.z += w * v[u].z;
        acc.w += w * v[u].w;
      }
    }
    if (warps_per_row > 1) {
      partial[warp][lane] = acc;
      __syncthreads();
      if (part == 0) {
        for (int w = 1; w < warps_per_row; ++w) {
          const float4 o = partial[warp + w][lane];
          acc.x += o.x;
          acc.y += o.y;
          acc.z += o.z;
          acc.w += o.w;
        }
      }
      __syncthreads();  // partial is rewritten by the next column chunk
    }
    if (mine && part == 0) {
      uint2 packed;
      packed.x = tc::ElemTraits<T>::Pack(acc.x, acc.y);
      packed.y = tc::ElemTraits<T>::Pack(acc.z, acc.w);
      *reinterpret_cast<uint2*>(out + d) = packed;
    }
  }
}

}  // namespace

template <typename T>
Status LaunchMergeSplits(const FwdParams& p, cudaStream_t stream) {
  const int64_t rows = p.shape.batch * p.shape.q_len * p.shape.q_heads;
  if (rows == 0) return Status::Ok();
  if (p.shape.v_dim() % 4 != 0) return Status::Unimplemented("split merge needs the value's head_dim % 4 == 0");
  const int warps_per_row = WarpsPerRow(p.num_splits);
  const int64_t blocks = CeilDiv(rows, kWarps / warps_per_row);
  if (blocks >= (int64_t{1} << 31)) return Status::Unimplemented("split merge: too many rows");
  MergeSplitsKernel<T><<<static_cast<unsigned>(blocks), 32 * kWarps, 0, stream>>>(p, warps_per_row);
  return CheckLaunch("split-KV merge");
}

template Status LaunchMergeSplits<__half>(const FwdParams&, cudaStream_t);
template Status LaunchMergeSplits<__nv_bfloat16>(const FwdParams&, cudaStream_t);

}  // namespace decode
}  // namespace jaxflash
