// SIMT attention kernels: fp32 arithmetic on CUDA cores, every dtype, every
// head_dim <= 256, every mask. They are the float32 path (fp32-class accuracy)
// and the fallback for shapes the tensor-core kernels do not cover; the
// dispatch switch decides which runs.
#pragma once

#include <cstddef>

#include "jaxflash/launch.h"
#include "jaxflash/params.h"

namespace jaxflash {

Status SimtAttentionForward(const FwdParams& params, cudaStream_t stream);
size_t SimtBackwardWorkspaceBytes(const BwdParams& params);
Status SimtAttentionBackward(const BwdParams& params, void* workspace, cudaStream_t stream);

}  // namespace jaxflash
