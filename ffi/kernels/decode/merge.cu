// The merge pass of split-KV: combines the per-split normalised outputs and
// base-2 LSEs (FwdParams::o_partial, lse_partial) into O and the natural-log
// LSE by the rule in common/decode.h (SplitMerge, shared with the CPU). One
// warp per output row. The lanes read the splits' LSEs side by side (split
// lane, lane + 32, ...) and join the rule's max and sum by shuffles; then each
// lane owns 4 columns and walks the splits with every load independent of the
// last, so a row's loads are in flight together. (A lane walking the splits
// one dependent load after another took 21 us for 32 rows of 29 splits on an
// H100, a tenth of the decode step it merged.) The partials are num_splits x
// the size of O in float32, small next to the K/V a split decode step reads.
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

constexpr int kWarpsPerBlock = 8;
constexpr int kBatch = 8;  // splits whose loads a lane has in flight together

template <typename T>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) MergeSplitsKernel(const FwdParams p) {
  const AttentionShape& sh = p.shape;
  const int64_t per_batch = sh.q_len * sh.q_heads;  // rows (query row, head) of one batch element
  const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= sh.batch * per_batch) return;
  const int lane = threadIdx.x & 31;
  const int64_t batch = row / per_batch, within = row % per_batch;
  const int splits = p.num_splits;
  const int head_dim = static_cast<int>(sh.head_dim);
  // Split s of this row: lse at lse_s[s * per_batch], output at o_s[s * per_batch * head_dim].
  const float* lse_s = p.lse_partial + batch * splits * per_batch + within;
  const float* o_s = p.o_partial + (batch * splits * per_batch + within) * head_dim;

  // The rule of common/decode.h: splits that saw no key of the row are
  // skipped, a row no split saw gets O = 0 and kEmptyRowLse, a NaN split LSE
  // makes the row NaN, and all -inf splits give 0 / 0 = NaN.
  const auto lse = [&](int s) { return s < splits ? lse_s[int64_t(s) * per_batch] : kEmptyRowLse; };
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
  if (lane == 0) {
    const int64_t head = within % sh.q_heads, q_row = within / sh.q_heads;
    p.lse[(batch * sh.q_heads + head) * sh.q_len + q_row] =
        merge.seen ? (merge.shift + __log2f(sum)) * 0.6931471805599453f : kEmptyRowLse;
  }
  // Every split stored all its rows (zeros where it saw no key), so every load
  // below reads written memory; a skipped split's value is loaded, then unused.
  T* out = static_cast<T*>(p.o) + row * head_dim;
  for (int d0 = 0; d0 < head_dim; d0 += 32 * 4) {  // the same trip count on every lane (shuffles)
    const int d = d0 + lane * 4;
    const bool mine = d < head_dim;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int base = 0; merge.seen && base < splits; base += 32) {
      const float lse_lane = lse(base + lane);
      const int n = splits - base < 32 ? splits - base : 32;
      // Eight splits' loads issued before any is used.
      for (int j0 = 0; j0 < n; j0 += kBatch) {
        float x[kBatch];
        float4 v[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int j = j0 + u;
          x[u] = __shfl_sync(kAll, lse_lane, j & 31);
          v[u] = mine && j < n ? *reinterpret_cast<const float4*>(o_s + int64_t(base + j) * per_batch * head_dim + d)
                               : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (j0 + u >= n || x[u] == kEmptyRowLse) continue;  // no split, or one skipped (not multiplied by 0)
          const float w = merge.Weight(x[u], exp2) * inv;
          acc.x += w * v[u].x;
          acc.y += w * v[u].y;
          acc.z += w * v[u].z;
          acc.w += w * v[u].w;
        }
      }
    }
    if (mine) {
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
  if (p.shape.head_dim % 4 != 0) return Status::Unimplemented("split merge needs head_dim % 4 == 0");
  const int64_t blocks = CeilDiv(rows, kWarpsPerBlock);
  if (blocks >= (int64_t{1} << 31)) return Status::Unimplemented("split merge: too many rows");
  MergeSplitsKernel<T><<<static_cast<unsigned>(blocks), 32 * kWarpsPerBlock, 0, stream>>>(p);
  return CheckLaunch("split-KV merge");
}

template Status LaunchMergeSplits<__half>(const FwdParams&, cudaStream_t);
template Status LaunchMergeSplits<__nv_bfloat16>(const FwdParams&, cudaStream_t);

}  // namespace decode
}  // namespace jaxflash
