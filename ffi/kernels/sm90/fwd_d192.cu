// sm90 forward instantiations for head-dim bucket 192 (fp16, bf16).
#include "sm90/fwd_launch.cuh"

namespace jaxflash {
namespace sm90 {
template Status LaunchForward<__half, 192>(const FwdParams&, const CudaDevice&, cudaStream_t);
template Status LaunchForward<__nv_bfloat16, 192>(const FwdParams&, const CudaDevice&, cudaStream_t);
}  // namespace sm90
}  // namespace jaxflash
