// sm90 backward instantiations for q/k head-dim bucket 192 with v bucket 128 (MLA; fp16, bf16).
#include "sm90/bwd_kernel.cuh"

namespace jaxflash {
namespace sm90 {
template Status LaunchBackward<__half, 192, 128>(const BwdParams&, const CudaDevice&, cudaStream_t);
template Status LaunchBackward<__nv_bfloat16, 192, 128>(const BwdParams&, const CudaDevice&, cudaStream_t);
}  // namespace sm90
}  // namespace jaxflash
