// sm90 backward instantiations for head-dim bucket 128 (fp16, bf16).
#include "sm90/bwd_kernel.cuh"

namespace jaxflash {
namespace sm90 {
template Status LaunchBackward<__half, 128>(const BwdParams&, const CudaDevice&, cudaStream_t);
template Status LaunchBackward<__nv_bfloat16, 128>(const BwdParams&, const CudaDevice&, cudaStream_t);

// (The dense tiles of buckets 64 and 128: head dims 33-64 and 97-128.)
bool TakesDenseBackward(const BwdParams& p) {
  const AttentionShape& sh = p.shape;
  const bool d64 = sh.head_dim > 32 && sh.head_dim <= 64, d128 = sh.head_dim > 96 && sh.head_dim <= 128;
  // (A positive scale: the staged bias is added in raw units, StagedBiasKeyMajor.)
  return (d64 || d128) && sh.v_dim() == sh.head_dim && tc::DenseTile::Stages(p) && !p.dense.mask.On() &&
         p.scale > 0.f && (d64 ? TileTakes<FusedBwdTile<64>::dense>(p) : TileTakes<FusedBwdTile<128>::dense>(p)) &&
         tc::UseFusedBackward(p);
}
}  // namespace sm90
}  // namespace jaxflash
