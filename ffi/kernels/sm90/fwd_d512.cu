// sm90 forward for head dims 257-512 (bucket 512; fp16, bf16): the column-split kernel.
#include "sm90/fwd_wide_kernel.cuh"

namespace jaxflash {
namespace sm90 {
template Status LaunchWideForward<__half>(const FwdParams&, const CudaDevice&, cudaStream_t);
template Status LaunchWideForward<__nv_bfloat16>(const FwdParams&, const CudaDevice&, cudaStream_t);

// dispatch.cu sends the kernel the calls past 256 this admits (the Python
// side, _native.wide_refusal, sends it no other).
bool TakesWideForward(const FwdParams& p) {
  const AttentionShape& sh = p.shape;
  return sh.head_dim > 256 && sh.head_dim <= WideFwdTile::kD && sh.head_dim % 8 == 0 && sh.v_dim() == sh.head_dim &&
         !p.dense.On() && p.softcap == 0.f && p.alibi == nullptr && p.mask.q_segments == nullptr &&
         p.num_splits <= 1 && p.paged.table == nullptr;
}
}  // namespace sm90
}  // namespace jaxflash
