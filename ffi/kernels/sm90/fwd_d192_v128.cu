// sm90 forward instantiations for q/k head-dim bucket 192 with v bucket 128 (MLA; fp16, bf16).
#include "sm90/fwd_launch.cuh"

namespace jaxflash {
namespace sm90 {
template Status LaunchForward<__half, 192, 128>(const FwdParams&, const CudaDevice&, cudaStream_t);
template Status LaunchForward<__nv_bfloat16, 192, 128>(const FwdParams&, const CudaDevice&, cudaStream_t);
}  // namespace sm90
}  // namespace jaxflash
