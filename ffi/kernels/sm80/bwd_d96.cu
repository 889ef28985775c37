// Backward instantiations for head-dim bucket 96 (fp16, bf16).
#include "sm80/bwd_kernel.cuh"

namespace jaxflash {
namespace sm80 {
template Status LaunchBackward<__half, 96>(const BwdParams&, const CudaDevice&, cudaStream_t);
template Status LaunchBackward<__nv_bfloat16, 96>(const BwdParams&, const CudaDevice&, cudaStream_t);
}  // namespace sm80
}  // namespace jaxflash
