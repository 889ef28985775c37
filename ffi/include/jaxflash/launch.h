// Entry points the handlers call. Kernels implement them; handlers never name
// a kernel template. Free of XLA and CUDA headers (see params.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "jaxflash/params.h"

// The CUDA runtime spells its stream type exactly this way, so declaring it
// here keeps CUDA headers out of this file without a conflicting definition.
typedef struct CUstream_st* cudaStream_t;

namespace jaxflash {

// An error message, or ok. Kernels report failures through this; nothing throws
// across the FFI boundary.
class Status {
 public:
  Status() = default;
  static Status Ok() { return Status(); }
  static Status InvalidArgument(std::string m) { return Status(Code::kInvalidArgument, std::move(m)); }
  static Status Unimplemented(std::string m) { return Status(Code::kUnimplemented, std::move(m)); }
  static Status Internal(std::string m) { return Status(Code::kInternal, std::move(m)); }

  enum class Code { kOk, kInvalidArgument, kUnimplemented, kInternal };
  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  Status(Code c, std::string m) : code_(c), message_(std::move(m)) {}
  Code code_ = Code::kOk;
  std::string message_;
};

// ---------------------------------------------------------------- CPU
// Runs fn(0) ... fn(n - 1), possibly in parallel on at most `threads` threads
// (the caller's among them), and returns when all are done.
class ParallelRunner {
 public:
  virtual ~ParallelRunner() = default;
  virtual void For(int64_t n, const std::function<void(int64_t)>& fn, int64_t threads) const = 0;
};

// The threads a CPU call of `products` tile products over every (query, key)
// pair of `sh` is worth (the forward 2, the backward 5): waking a pool thread
// costs tens of microseconds, more than a small call's whole work (2 cores,
// B 1, 8 heads, S 16, D 64: forward+backward 166 us on two threads, 76 us on
// one), so each thread gets at least kCpuFlopsPerThread (~40 us).
constexpr double kCpuFlopsPerThread = 4e6;
inline int64_t CpuThreadsFor(const AttentionShape& sh, double products) {
  const double flops = 2.0 * products * sh.batch * sh.q_heads * sh.q_len * sh.kv_len * sh.head_dim;
  return flops < 2 * kCpuFlopsPerThread ? 1 : static_cast<int64_t>(flops / kCpuFlopsPerThread);
}

// The threads the CPU backward runs a call of `sh` on (its five tile products
// a pair). jaxflash/_native.py reads it (the extension's cpu_backward_threads)
// to decide whether a call leaves room for the one-pass scheme's dQ sums.
int64_t CpuBackwardThreads(const AttentionShape& sh);

Status CpuAttentionForward(const FwdParams& params, const ParallelRunner& runner);
// params.delta must point at batch * q_heads * q_len floats.
Status CpuAttentionBackward(const BwdParams& params, const ParallelRunner& runner);
// The dense bias's gradient alone (params.dbias; params.delta as above; dq, dk,
// dv untouched).
Status CpuBiasGradient(const BwdParams& params, const ParallelRunner& runner);

// ---------------------------------------------------------------- CUDA
// Built only when the CUDA part of the extension is compiled.
struct CudaDevice {
  int ordinal = 0;
  int arch = 0;             // compute capability, e.g. 80, 90
  int sm_count = 0;
  size_t max_smem_per_block = 0;  // opt-in limit
};

// Queries (and caches) the properties of the current device.
Status CudaCurrentDevice(CudaDevice* device);

Status CudaAttentionForward(const FwdParams& params, const CudaDevice& device, cudaStream_t stream);
// Device scratch the backward needs. It must fit in params.delta (an output
// buffer of batch * q_heads * q_len floats), which the handler passes as
// `workspace`: handlers do not allocate, because XLA's scratch allocator is
// unavailable when the call is captured into a command buffer.
size_t CudaBackwardWorkspaceBytes(const BwdParams& params, const CudaDevice& device);
// `workspace` holds CudaBackwardWorkspaceBytes bytes, 256-byte aligned.
Status CudaAttentionBackward(const BwdParams& params, void* workspace, const CudaDevice& device,
                             cudaStream_t stream);

// The dense bias's gradient alone (params.dbias; params.delta as the
// backward's; dq, dk, dv untouched): 16-bit inputs on sm80 and newer.
Status CudaBiasGradient(const BwdParams& params, const CudaDevice& device, cudaStream_t stream);

// Both segment tables of a call (SegmentTableParams), on the stream.
Status CudaSegmentTables(const SegmentTableParams& params, const CudaDevice& device, cudaStream_t stream);

}  // namespace jaxflash
