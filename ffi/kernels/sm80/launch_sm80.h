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
Status LaunchBackward(const BwdParams& p, void* workspace, const CudaDevice& device, cudaStream_t stream);

// Backward workspace: delta, then (unless the call is deterministic) the fp32
// dQ accumulator at the next 256-byte boundary. The Python side sizes the
// workspace output by the same rule (attention._backward_workspace_elems).
inline size_t DeltaBytesAligned(const BwdParams& p) {
  const size_t bytes = size_t(p.shape.batch * p.shape.q_heads * p.shape.q_len) * sizeof(float);
  return (bytes + 255) / 256 * 256;
}

inline size_t BackwardWorkspaceBytes(const BwdParams& p) {
  const size_t delta = size_t(p.shape.batch * p.shape.q_heads * p.shape.q_len) * sizeof(float);
  if (p.deterministic) return delta;
  const size_t accum = size_t(p.shape.batch * p.shape.q_len * p.shape.q_heads * p.shape.head_dim) * sizeof(float);
  return DeltaBytesAligned(p) + accum;
}

}  // namespace sm80
}  // namespace jaxflash
