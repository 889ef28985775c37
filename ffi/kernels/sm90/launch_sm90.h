// Declarations of the sm90 (Hopper, wgmma) launchers, for the dispatch
// switch; instantiated once per (dtype, head-dim bucket) in fwd_d*.cu and
// bwd_d*.cu.
#pragma once

#include "jaxflash/launch.h"
#include "jaxflash/params.h"

namespace jaxflash {
namespace sm90 {

// Instantiated for head-dim buckets 64, 128, 192 and 256; the others run the sm80
// kernels (the dispatch switch names each bucket). kDv: the value's bucket
// where a pair has kernels of its own (192 with 128: MLA).
template <typename T, int kD, int kDv = kD>
Status LaunchForward(const FwdParams& p, const CudaDevice& device, cudaStream_t stream);

// Head dims 257-512 (fwd_wide_kernel.cuh: O's columns split over two
// consumer warpgroups), forward only, for the calls TakesWideForward admits:
// one head dim for q, k and v, no dense term, soft-cap, ALiBi or segment ids
// (those, and the backward, run Pallas; the Python side sends no other).
template <typename T>
Status LaunchWideForward(const FwdParams& p, const CudaDevice& device, cudaStream_t stream);
bool TakesWideForward(const FwdParams& p);

// Instantiated for head-dim buckets 64, 128, 192 and 256. Needs no workspace beyond the
// delta output (p.delta).
template <typename T, int kD, int kDv = kD>
Status LaunchBackward(const BwdParams& p, const CudaDevice& device, cudaStream_t stream);

// Whether the backward's dense tiles (buckets 64 and 128, bwd_ws_kernel.cuh)
// take a call with a dense term: a 16-bit bias they stage (DenseTile::Stages),
// no mask, soft-cap, segment ids or ALiBi, one head dim, a positive scale, the
// fused pass (UseFusedBackward). Every other dense call runs the sm80 kernels,
// and only these emit dS into dB (BwdParams::ds_out).
bool TakesDenseBackward(const BwdParams& p);

// The bias-gradient pass (sm80/bias_grad_kernel.cuh's walk, its products by
// wgmma; bias_grad.cu): buckets 64 and 128.
template <typename T, int kD>
Status LaunchBiasGradient(const BwdParams& p, const CudaDevice& device, cudaStream_t stream);

}  // namespace sm90
}  // namespace jaxflash
