// Bias-gradient instantiations for head-dim bucket 256 (fp16, bf16).
#include "sm80/bias_grad_kernel.cuh"

namespace jaxflash {
namespace sm80 {
template Status LaunchBiasGradient<__half, 256>(const BwdParams&, const CudaDevice&, cudaStream_t);
template Status LaunchBiasGradient<__nv_bfloat16, 256>(const BwdParams&, const CudaDevice&, cudaStream_t);
}  // namespace sm80
}  // namespace jaxflash
