// The one dispatch switch of the CUDA path: (arch, dtype, head-dim bucket)
// -> compiled variant. Masks are runtime policies inside every variant
// (MaskPolicy), so they add no instantiations here.
//
//   fp16/bf16, split-KV, paged K/V or a short query (decode::UseDecodeKernel)
//       -> the decode kernels (GQA-packed rows, split keys), arch >= 80,
//          bucket = the wider of q/k's and v's head dims (v keeps its own)
//   fp16/bf16, arch == 90, buckets 64, 128, 192, 256
//       -> sm90 kernels (wgmma), when the build has sm_90a code; a call
//          whose v has a head dim of its own (MLA: q/k in (128, 192], v up
//          to 128) the (192, 128) pair's (TakesValueWidth)
//   fp16/bf16, arch >= 80, head_dim % 8 == 0, head_dim <= 256
//       -> sm80 tensor-core kernels (mma.sync), bucket = smallest compiled
//          head dim >= head_dim; the kernels zero-pad the rest.
//   everything else (float32 in particular)
//       -> SIMT kernels (fp32 arithmetic, every dtype and head dim).
//   A dense bias or mask (params.h DenseParams): the forward on the sm90
//   dense tile at D 64 and 128 for a 16-bit bias it stages without a mask
//   (no soft-cap, ALiBi, segment ids or forced tile), else on the sm80
//   kernels on every arch (fp16/bf16 only; no decode, split-KV or SIMT path
//   takes one); the backward on the sm80 kernels, and its bias's gradient the
//   sm80 bias-gradient kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <string>

#include "common/launch_util.cuh"
#include "decode/launch_decode.h"
#include "jaxflash/launch.h"
#include "jaxflash/params.h"
#include "sm80/launch_sm80.h"
#include "sm90/launch_sm90.h"
#include "simt/simt.h"

namespace jaxflash {

namespace {

// 0 when no compiled bucket covers head_dim.
int HeadDimBucket(int64_t head_dim) {
  if (head_dim <= 0 || head_dim % 8 != 0) return 0;
  for (int b : sm80::kHeadDimBuckets) {
    if (head_dim <= b) return b;
  }
  return 0;
}

// Why the tensor-core kernels cannot take this call (empty when they can).
std::string TensorCoreRefusal(DType dtype, const AttentionShape& sh, const CudaDevice& device) {
  if (dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    return std::string("dtype ") + DTypeName(dtype) + " runs on the SIMT kernels";
  }
  if (device.arch < 80) return "tensor-core kernels need compute capability 8.0 or newer";
  if (HeadDimBucket(sh.head_dim) == 0) {
    return "head_dim " + std::to_string(sh.head_dim) + " is not a multiple of 8 in [8, 256]";
  }
  if (sh.q_len >= (int64_t{1} << 31) || sh.kv_len >= (int64_t{1} << 31)) {
    return "sequence lengths must be below 2^31";
  }
  if (sh.q_heads > 65535 || sh.kv_heads > 65535 || sh.batch * 2 > 65535) {
    return "batch and head counts must be at most 65535 (batch at most 32767)";
  }
  return std::string();
}

// Whether the Hopper kernels may take this call (the switches below then pick
// them for the buckets they have). They are real code only in the sm_90a
// binary (JAXFLASH_SM90A_BUILT), which is the one an arch-90 GPU loads; the
// sm80 family can be forced for testing (the `tile` of FwdParams, BwdParams).
bool Sm90Allowed(int tile, const CudaDevice& device) {
#if defined(JAXFLASH_SM90A_BUILT)
  return device.arch == 90 && !(tile & FwdParams::kTileSm80);
#else
  return false;
#endif
}

// The wider of q/k's and v's head dims: the decode kernels' tile takes it,
// and it is the one the head-dim limit applies to.
inline int64_t WidestDim(const AttentionShape& sh) { return sh.v_dim() > sh.head_dim ? sh.v_dim() : sh.head_dim; }

template <typename T>
Status DecodeBucket(const FwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  const bool tma = Sm90Allowed(p.tile, device);  // with kTileSm80, the cp.async loader (tests)
  switch (HeadDimBucket(WidestDim(p.shape))) {
    case 32: return decode::LaunchDecode<T, 32>(p, device, stream, tma);
    case 64: return decode::LaunchDecode<T, 64>(p, device, stream, tma);
    case 96: return decode::LaunchDecode<T, 96>(p, device, stream, tma);
    case 128: return decode::LaunchDecode<T, 128>(p, device, stream, tma);
    case 192: return decode::LaunchDecode<T, 192>(p, device, stream, tma);
    case 256: return decode::LaunchDecode<T, 256>(p, device, stream, tma);
  }
  return Status::Unimplemented("no decode kernel for head_dim " + std::to_string(p.shape.head_dim));
}

// Whether the kernels read v at a head dim of its own (else every kernel
// takes q, k and v at one, and the Python side pads the narrower:
// _native.value_width_on mirrors this). The training kernels: the Hopper
// kernels of the (192, 128) bucket pair, for 16-bit calls without a dense
// term (forward and backward; the sm80 kernels take one head dim). The
// decode kernels (split-KV, paged K/V, short queries), forward only: 16-bit
// calls without a dense term whose head dims are multiples of 8.
template <typename Params>
bool TakesValueWidth(const Params& p, const CudaDevice& device) {
  const AttentionShape& sh = p.shape;
  return Sm90Allowed(p.tile, device) && TensorCoreRefusal(p.dtype, sh, device).empty() && !p.dense.On() &&
         HeadDimBucket(sh.head_dim) == 192 && sh.v_dim() % 8 == 0 && sh.v_dim() <= 128;
}
bool ForwardTakesValueWidth(const FwdParams& p, const CudaDevice& device) {
  const AttentionShape& sh = p.shape;
  if (decode::UseDecodeKernel(p)) {
    AttentionShape wider = sh;  // the decode tile's width (DecodeBucket)
    wider.head_dim = WidestDim(sh);
    return TensorCoreRefusal(p.dtype, sh, device).empty() && TensorCoreRefusal(p.dtype, wider, device).empty() &&
           !p.dense.On() && sh.v_dim() % 8 == 0;
  }
  return TakesValueWidth(p, device);
}

template <typename T>
Status ForwardBucket(FwdParams p, const CudaDevice& device, cudaStream_t stream) {
  const bool dense = p.dense.On();
  if (!dense && decode::UseDecodeKernel(p)) return DecodeBucket<T>(p, device, stream);
  if (p.shape.v_dim() != p.shape.head_dim) {  // ForwardTakesValueWidth (CudaAttentionForward)
    return sm90::LaunchForward<T, 192, 128>(p, device, stream);
  }
  const int bucket = HeadDimBucket(p.shape.head_dim);
  // D 64 and 128 have a dense tile (for the calls it takes: sm90's
  // LaunchForward); a dense call with a forced tile (tests) runs that
  // candidate of the sm80 kernels, as before the tile existed.
  const bool forced = !(p.tile & FwdParams::kTilePreferred) && p.tile % FwdParams::kTileSm80 != 0;
  if (Sm90Allowed(p.tile, device) && (!dense || (bucket <= 128 && !forced))) {
    switch (bucket) {
      case 64: return sm90::LaunchForward<T, 64>(p, device, stream);
      case 128: return sm90::LaunchForward<T, 128>(p, device, stream);
      case 192: return sm90::LaunchForward<T, 192>(p, device, stream);
      case 256: return sm90::LaunchForward<T, 256>(p, device, stream);
    }
  }
  p.tile &= ~FwdParams::kTileSm80;  // the candidate within the sm80 family (a preference stays one)
  // A cached preference was measured on plain calls (on Hopper, for the sm90
  // family): a dense call takes the table's pick among its own tiles.
  if (dense && (p.tile & FwdParams::kTilePreferred)) p.tile = 0;
  switch (bucket) {
    case 32: return sm80::LaunchForward<T, 32>(p, device, stream);
    case 64: return sm80::LaunchForward<T, 64>(p, device, stream);
    case 96: return sm80::LaunchForward<T, 96>(p, device, stream);
    case 128: return sm80::LaunchForward<T, 128>(p, device, stream);
    case 192: return sm80::LaunchForward<T, 192>(p, device, stream);
    case 256: return sm80::LaunchForward<T, 256>(p, device, stream);
  }
  return Status::Unimplemented("no tensor-core forward for head_dim " + std::to_string(p.shape.head_dim));
}

template <typename T>
Status BackwardBucket(const BwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  if (p.shape.v_dim() != p.shape.head_dim) {  // TakesValueWidth (CudaAttentionBackward)
    return sm90::LaunchBackward<T, 192, 128>(p, device, stream);
  }
  const int bucket = HeadDimBucket(p.shape.head_dim);
  const bool sm90 = Sm90Allowed(p.tile, device);
  const bool sm90_dense = sm90 && p.dense.On() && sm90::TakesDenseBackward(p);
  if (p.ds_out.On() && !sm90_dense) {
    return Status::InvalidArgument("dB out was asked of a backward call the Hopper dense tile does not take");
  }
  if (sm90 && (!p.dense.On() || sm90_dense)) {
    switch (bucket) {
      case 64: return sm90::LaunchBackward<T, 64>(p, device, stream);
      case 128: return sm90::LaunchBackward<T, 128>(p, device, stream);
      case 192: return sm90::LaunchBackward<T, 192>(p, device, stream);
      case 256: return sm90::LaunchBackward<T, 256>(p, device, stream);
    }
  }
  switch (bucket) {
    case 32: return sm80::LaunchBackward<T, 32>(p, device, stream);
    case 64: return sm80::LaunchBackward<T, 64>(p, device, stream);
    case 96: return sm80::LaunchBackward<T, 96>(p, device, stream);
    case 128: return sm80::LaunchBackward<T, 128>(p, device, stream);
    case 192: return sm80::LaunchBackward<T, 192>(p, device, stream);
    case 256: return sm80::LaunchBackward<T, 256>(p, device, stream);
  }
  return Status::Unimplemented("no tensor-core backward for head_dim " + std::to_string(p.shape.head_dim));
}

// Why the CUDA kernels cannot take a call's dense bias or mask (empty when
// they can, or when it has none). The Python side never sends these.
template <typename Params>
std::string DenseRefusal(const Params& p, const CudaDevice& device) {
  if (!p.dense.On()) return std::string();
  if (const std::string why = TensorCoreRefusal(p.dtype, p.shape, device); !why.empty()) {
    return "a dense bias or mask runs on the tensor-core kernels only (" + why + ")";
  }
  if (p.dense.bias.On() && p.softcap > 0.f) return "a dense bias beside a logit soft-cap has no CUDA kernel";
  return std::string();
}

// The bias-gradient kernel of the smallest compiled bucket >= head_dim (<= 256:
// HeadDimRefusal); narrower heads run zero-padded.
template <typename T>
Status BiasGradientBucket(const BwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  if (Sm90Allowed(p.tile, device) && p.shape.head_dim <= 128) {  // the same walk, its products by wgmma
    if (p.shape.head_dim <= 64) return sm90::LaunchBiasGradient<T, 64>(p, device, stream);
    return sm90::LaunchBiasGradient<T, 128>(p, device, stream);
  }
  if (p.shape.head_dim <= 64) return sm80::LaunchBiasGradient<T, 64>(p, device, stream);
  if (p.shape.head_dim <= 128) return sm80::LaunchBiasGradient<T, 128>(p, device, stream);
  return sm80::LaunchBiasGradient<T, 256>(p, device, stream);
}

}  // namespace

Status CudaCurrentDevice(CudaDevice* device) {
  int ordinal = 0;
  cudaError_t err = cudaGetDevice(&ordinal);
  if (err != cudaSuccess) return Status::Internal(std::string("cudaGetDevice: ") + cudaGetErrorString(err));
  // Properties never change for a device; query them once per ordinal.
  constexpr int kMaxDevices = 64;
  static CudaDevice cache[kMaxDevices];
  static std::atomic<bool> cached[kMaxDevices];
  if (ordinal < kMaxDevices && cached[ordinal].load(std::memory_order_acquire)) {
    *device = cache[ordinal];
    return Status::Ok();
  }
  int major = 0, minor = 0, sms = 0, smem = 0;
  if ((err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ordinal)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, ordinal)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinal)) != cudaSuccess ||
      (err = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, ordinal)) != cudaSuccess) {
    return Status::Internal(std::string("cudaDeviceGetAttribute: ") + cudaGetErrorString(err));
  }
  CudaDevice d;
  d.ordinal = ordinal;
  d.arch = major * 10 + minor;
  d.sm_count = sms;
  d.max_smem_per_block = static_cast<size_t>(smem);
  if (ordinal < kMaxDevices) {
    cache[ordinal] = d;  // identical values if two threads race here
    cached[ordinal].store(true, std::memory_order_release);
  }
  *device = d;
  return Status::Ok();
}

// own_value_width: the call's kernels read v at its own head dim.
static Status HeadDimRefusal(const AttentionShape& sh, bool own_value_width = false) {
  if (sh.v_dim() != sh.head_dim && !own_value_width) {  // the Python side pads the narrower side
    return Status::Unimplemented("the CUDA kernels take one head dim for q, k and v, got " +
                                 std::to_string(sh.head_dim) + " and " + std::to_string(sh.v_dim()));
  }
  const int64_t widest = WidestDim(sh);
  if (widest <= kMaxCudaHeadDim) return Status::Ok();
  return Status::Unimplemented("the CUDA kernels support head_dim <= " + std::to_string(kMaxCudaHeadDim) +
                               ", got " + std::to_string(widest));
}

// Whether the Hopper forward for head dims 257-512 takes the call (at any
// query length: the decode kernels stop at 256).
bool WideForward(const FwdParams& p, const CudaDevice& device) {
  const AttentionShape& sh = p.shape;
  AttentionShape narrow = sh;  // every other refusal of the tensor-core kernels
  narrow.head_dim = narrow.v_head_dim = 256;
  return sh.head_dim > kMaxCudaHeadDim && Sm90Allowed(p.tile, device) &&
         TensorCoreRefusal(p.dtype, narrow, device).empty() && sm90::TakesWideForward(p);
}

Status CudaAttentionForward(const FwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  if (WideForward(p, device)) {
    if (p.dtype == DType::kFloat16) return sm90::LaunchWideForward<__half>(p, device, stream);
    return sm90::LaunchWideForward<__nv_bfloat16>(p, device, stream);
  }
  if (Status s = HeadDimRefusal(p.shape, ForwardTakesValueWidth(p, device)); !s.ok()) return s;
  if (const std::string why = DenseRefusal(p, device); !why.empty()) return Status::Unimplemented(why);
  if (!TensorCoreRefusal(p.dtype, p.shape, device).empty()) return SimtAttentionForward(p, stream);
  if (p.dtype == DType::kFloat16) return ForwardBucket<__half>(p, device, stream);
  return ForwardBucket<__nv_bfloat16>(p, device, stream);
}

size_t CudaBackwardWorkspaceBytes(const BwdParams& p, const CudaDevice& device) {
  if (!TensorCoreRefusal(p.dtype, p.shape, device).empty()) return SimtBackwardWorkspaceBytes(p);
  return 0;  // the tensor-core backwards use only the delta output (p.delta)
}

Status CudaAttentionBackward(const BwdParams& p, void* workspace, const CudaDevice& device, cudaStream_t stream) {
  if (Status s = HeadDimRefusal(p.shape, TakesValueWidth(p, device)); !s.ok()) return s;
  if (const std::string why = DenseRefusal(p, device); !why.empty()) return Status::Unimplemented(why);
  if (!TensorCoreRefusal(p.dtype, p.shape, device).empty()) return SimtAttentionBackward(p, workspace, stream);
  if (p.dtype == DType::kFloat16) return BackwardBucket<__half>(p, device, stream);
  return BackwardBucket<__nv_bfloat16>(p, device, stream);
}

Status CudaBiasGradient(const BwdParams& p, const CudaDevice& device, cudaStream_t stream) {
  if (Status s = HeadDimRefusal(p.shape); !s.ok()) return s;
  if (const std::string why = DenseRefusal(p, device); !why.empty()) return Status::Unimplemented(why);
  if (!p.dense.bias.On()) return Status::InvalidArgument("the bias gradient needs a bias");
  if (p.dtype == DType::kFloat16) return BiasGradientBucket<__half>(p, device, stream);
  return BiasGradientBucket<__nv_bfloat16>(p, device, stream);
}

}  // namespace jaxflash
