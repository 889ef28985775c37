// Declarations of the sm80 launchers, for the dispatch switch. Their
// definitions live in fwd_kernel.cuh / bwd_kernel.cuh and are instantiated
// once per (dtype, head-dim bucket) in fwd_d*.cu / bwd_d*.cu, so including
// this header never instantiates a kernel.
#pragma once

#include <cstddef>

#include "jaxflash/launch.h"
#include "jaxflash/params.h"

namespace jaxflash {
namespace sm80 {

// Head-dim buckets with compiled kernels (each has a fwd_d*.cu and bwd_d*.cu).
constexpr int kHeadDimBuckets[] = {32, 64, 96, 128, 192, 256};

template <typename T, int kD>
Status LaunchForward(const FwdParams& p, const CudaDevice& device, cudaStream_t stream);

template <typename T, int kD>
Status LaunchBackward(const BwdParams& p, const CudaDevice& device, cudaStream_t stream);

// The dense bias's gradient (bias_grad_kernel.cuh), for buckets 64, 128 and
// 256 only (bias_grad_d*.cu): narrower heads run zero-padded in the next.
template <typename T, int kD>
Status LaunchBiasGradient(const BwdParams& p, const CudaDevice& device, cudaStream_t stream);

}  // namespace sm80
}  // namespace jaxflash
