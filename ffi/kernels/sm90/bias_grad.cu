// sm90 bias-gradient instantiations (buckets 64 and 128; fp16, bf16): the sm80
// kernel's walk on BiasGradTileSm90, its products by wgmma. (At D 256 its
// 64-key tile spilled 32 bytes; that bucket runs the sm80 kernel.)
#include "sm80/bias_grad_kernel.cuh"
#include "sm90/launch_sm90.h"

namespace jaxflash {
namespace sm90 {
template <typename T, int kD>
Status LaunchBiasGradient(const BwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  return sm80::LaunchBiasGradientTile<T, sm80::BiasGradTileSm90<kD>>(p, device, stream);
}
template Status LaunchBiasGradient<__half, 64>(const BwdParams&, const CudaDevice&, cudaStream_t);
template Status LaunchBiasGradient<__nv_bfloat16, 64>(const BwdParams&, const CudaDevice&, cudaStream_t);
template Status LaunchBiasGradient<__half, 128>(const BwdParams&, const CudaDevice&, cudaStream_t);
template Status LaunchBiasGradient<__nv_bfloat16, 128>(const BwdParams&, const CudaDevice&, cudaStream_t);
}  // namespace sm90
}  // namespace jaxflash
