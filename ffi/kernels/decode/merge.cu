// The merge pass of split-KV: combines the per-split normalised outputs and
// base-2 LSEs (FwdParams::o_partial, lse_partial) into O and the natural-log
// LSE by the rule in common/decode.h (SplitMerge, shared with the CPU). One warp per output row; lanes take 4
// columns at a time with 16-byte loads. The partials are num_splits x the
// size of O in float32, small next to the K/V a split decode step reads.
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
  const auto lse = [&](int s) { return lse_s[s * per_batch]; };
  const SplitMerge merge = SplitMerge::Of(splits, lse);
  const auto exp2 = [](float x) { return tc::Exp2(x); };
  float sum = 0.f;
  for (int s = 0; s < splits; ++s) sum += merge.Weight(lse(s), exp2);
  const float inv = merge.seen ? 1.f / sum : 0.f;
  if (lane == 0) {
    const int64_t head = within % sh.q_heads, q_row = within / sh.q_heads;
    p.lse[(batch * sh.q_heads + head) * sh.q_len + q_row] =
        merge.seen ? (merge.shift + __log2f(sum)) * 0.6931471805599453f : kEmptyRowLse;
  }
  T* out = static_cast<T*>(p.o) + row * head_dim;
  for (int d = lane * 4; d < head_dim; d += 32 * 4) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    if (merge.seen) {
      for (int s = 0; s < splits; ++s) {
        if (lse(s) == kEmptyRowLse) continue;  // skipped, not multiplied by 0
        const float w = merge.Weight(lse(s), exp2) * inv;
        const float4 x = *reinterpret_cast<const float4*>(o_s + s * per_batch * head_dim + d);
        acc.x += w * x.x;
        acc.y += w * x.y;
        acc.z += w * x.z;
        acc.w += w * x.w;
      }
    }
    uint2 packed;
    packed.x = tc::ElemTraits<T>::Pack(acc.x, acc.y);
    packed.y = tc::ElemTraits<T>::Pack(acc.z, acc.w);
    *reinterpret_cast<uint2*>(out + d) = packed;
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
