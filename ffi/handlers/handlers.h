// The FFI handler symbols the extension module exports as capsules.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxflashCpuForwardV5(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuBackwardV5(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuBackwardDb(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuBiasGradient(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuBiasGradientV2(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuForward(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuPagedForward(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuPagedForwardV3(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuPagedForwardV2(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuBackward(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuForwardV3(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuBackwardV3(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuForwardV2(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuBackwardV2(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuForwardV1(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuPagedForwardV1(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCpuBackwardV1(XLA_FFI_CallFrame* call_frame);
#ifdef JAXFLASH_WITH_CUDA
XLA_FFI_Error* JaxflashCudaForward(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaPagedForward(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaPagedForwardV3(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaPagedForwardV2(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaBackward(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaForwardV3(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaBackwardV3(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaForwardV2(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaBackwardV2(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaForwardV1(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaPagedForwardV1(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaBackwardV1(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaSegmentTables(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaForwardV5(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaBackwardV5(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaBiasGradient(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaBiasGradientV2(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaBackwardDb(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxflashCudaBackwardDs(XLA_FFI_CallFrame* call_frame);
#endif
}
