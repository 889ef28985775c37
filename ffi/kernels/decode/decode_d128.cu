// Decode instantiations for head-dim bucket 128 (fp16, bf16).
#include "decode/decode_kernel.cuh"

namespace jaxflash {
namespace decode {
template Status LaunchDecode<__half, 128>(const FwdParams&, const CudaDevice&, cudaStream_t, bool);
template Status LaunchDecode<__nv_bfloat16, 128>(const FwdParams&, const CudaDevice&, cudaStream_t, bool);
}  // namespace decode
}  // namespace jaxflash
