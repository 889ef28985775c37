// Decode instantiations for head-dim bucket 192 (fp16, bf16).
#include "decode/decode_kernel.cuh"

namespace jaxflash {
namespace decode {
template Status LaunchDecode<__half, 192>(const FwdParams&, const CudaDevice&, cudaStream_t, bool);
template Status LaunchDecode<__nv_bfloat16, 192>(const FwdParams&, const CudaDevice&, cudaStream_t, bool);
}  // namespace decode
}  // namespace jaxflash
