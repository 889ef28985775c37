// Declarations of the sm90 (Hopper, wgmma) launchers, for the dispatch
// switch; instantiated once per (dtype, head-dim bucket) in fwd_d*.cu.
#pragma once

#include "jaxflash/launch.h"
#include "jaxflash/params.h"

namespace jaxflash {
namespace sm90 {

// Head-dim buckets with an sm90 forward; the others run the sm80 kernels.
constexpr int kHeadDimBuckets[] = {64, 128, 256};

template <typename T, int kD>
Status LaunchForward(const FwdParams& p, const CudaDevice& device, cudaStream_t stream);

}  // namespace sm90
}  // namespace jaxflash
