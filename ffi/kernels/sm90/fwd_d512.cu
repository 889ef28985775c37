// sm90 forward for head dims 257-512 (bucket 512; fp16, bf16): the column-split kernel.
#include "sm90/fwd_wide_kernel.cuh"

namespace jaxflash {
namespace sm90 {
template Status LaunchWideForward<__half>(const FwdParams&, const CudaDevice&, cudaStream_t);
template Status LaunchWideForward<__nv_bfloat16>(const FwdParams&, const CudaDevice&, cudaStream_t);

bool TakesWideForward(const FwdParams& p) { return WideForwardTakes(p); }
}  // namespace sm90
}  // namespace jaxflash
