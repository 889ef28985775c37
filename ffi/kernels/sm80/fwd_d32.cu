// Forward instantiations for head-dim bucket 32 (fp16, bf16).
#include "sm80/fwd_kernel.cuh"

namespace jaxflash {
namespace sm80 {
template Status LaunchForward<__half, 32>(const FwdParams&, const CudaDevice&, cudaStream_t);
template Status LaunchForward<__nv_bfloat16, 32>(const FwdParams&, const CudaDevice&, cudaStream_t);
}  // namespace sm80
}  // namespace jaxflash
