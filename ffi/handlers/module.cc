// The extension module: hands the FFI handlers to Python as capsules, says
// how it was built so Python can refuse a build that would not load, and
// gives the CPU backward's thread rule, by which Python sizes its dQ sums.
#include <nanobind/nanobind.h>

#include "handlers.h"
#include "jaxflash/launch.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

using Handler = XLA_FFI_Error*(XLA_FFI_CallFrame*);

// One platform's targets, newest first: forward, backward and the paged
// forward at v4 (v3 + the ALiBi slopes), v3 (v2 + the segment tables) and v2
// (v1 + the softcap attribute), and every v1, kept for programs exported
// before the versions after it.
struct PlatformTargets {
  Handler *fwd, *bwd, *fwd_v3, *bwd_v3, *fwd_v2, *paged, *paged_v3, *paged_v2, *bwd_v2, *fwd_v1, *paged_v1, *bwd_v1;
};
nb::dict Targets(const PlatformTargets& t) {
  nb::dict d;
  d["jaxflash_fwd_v4"] = Capsule(t.fwd);
  d["jaxflash_bwd_v4"] = Capsule(t.bwd);
  d["jaxflash_fwd_v3"] = Capsule(t.fwd_v3);
  d["jaxflash_bwd_v3"] = Capsule(t.bwd_v3);
  d["jaxflash_fwd_v2"] = Capsule(t.fwd_v2);
  d["jaxflash_paged_fwd_v4"] = Capsule(t.paged);
  d["jaxflash_paged_fwd_v3"] = Capsule(t.paged_v3);
  d["jaxflash_paged_fwd_v2"] = Capsule(t.paged_v2);
  d["jaxflash_bwd_v2"] = Capsule(t.bwd_v2);
  d["jaxflash_fwd_v1"] = Capsule(t.fwd_v1);
  d["jaxflash_paged_fwd_v1"] = Capsule(t.paged_v1);
  d["jaxflash_bwd_v1"] = Capsule(t.bwd_v1);
  return d;
}

}  // namespace

// The target names carry the version of their interface: operands, results and
// attributes (params.h's order and meaning). A program exported with
// jax.export records the names, so a change to any of them is a new version
// registered beside the old one, never an edit of a shipped one; the Python
// side names them in jaxflash/_native.py (TARGETS).
NB_MODULE(_jaxflash, m) {
  m.doc() = "jaxflash FFI handlers";
  m.def("cpu_targets", [] {
    nb::dict d = Targets({JaxflashCpuForward, JaxflashCpuBackward, JaxflashCpuForwardV3, JaxflashCpuBackwardV3,
                    JaxflashCpuForwardV2, JaxflashCpuPagedForward, JaxflashCpuPagedForwardV3, JaxflashCpuPagedForwardV2,
                    JaxflashCpuBackwardV2, JaxflashCpuForwardV1, JaxflashCpuPagedForwardV1, JaxflashCpuBackwardV1});
    // v5 is v4 + the dense bias and mask; calls without a dense term keep
    // using v4 on both platforms.
    d["jaxflash_fwd_v5"] = Capsule(JaxflashCpuForwardV5);
    d["jaxflash_bwd_v5"] = Capsule(JaxflashCpuBackwardV5);
    // The bias's gradient alone (the backward v5's operands; result dB: v2 in
    // the bias's dtype, v1 in float32).
    d["jaxflash_bias_grad_v2"] = Capsule(JaxflashCpuBiasGradientV2);
    d["jaxflash_bias_grad_v1"] = Capsule(JaxflashCpuBiasGradient);
    // The v5 backward with dB out, where each bias entry has one (batch, head).
    d["jaxflash_bwd_db_v1"] = Capsule(JaxflashCpuBackwardDb);
    return d;
  });
  m.def("cuda_targets", [] {
#ifdef JAXFLASH_WITH_CUDA
    // The segment tables have a kernel on the GPU only (elsewhere XLA builds them:
    // jaxflash/segments.py).
    nb::dict d = Targets({JaxflashCudaForward, JaxflashCudaBackward, JaxflashCudaForwardV3, JaxflashCudaBackwardV3,
                    JaxflashCudaForwardV2, JaxflashCudaPagedForward, JaxflashCudaPagedForwardV3, JaxflashCudaPagedForwardV2,
                    JaxflashCudaBackwardV2, JaxflashCudaForwardV1, JaxflashCudaPagedForwardV1, JaxflashCudaBackwardV1});
    d["jaxflash_segment_tables_v1"] = Capsule(JaxflashCudaSegmentTables);
    d["jaxflash_fwd_v5"] = Capsule(JaxflashCudaForwardV5);
    d["jaxflash_bwd_v5"] = Capsule(JaxflashCudaBackwardV5);
    d["jaxflash_bias_grad_v2"] = Capsule(JaxflashCudaBiasGradientV2);
    d["jaxflash_bias_grad_v1"] = Capsule(JaxflashCudaBiasGradient);
    // The v5 backward with dB out (the Hopper dense tile's).
    d["jaxflash_bwd_db_v1"] = Capsule(JaxflashCudaBackwardDb);
    d["jaxflash_bwd_ds_v1"] = Capsule(JaxflashCudaBackwardDs);  // the older dense backward with dS out
    return d;
#else
    return nb::dict();
#endif
  });
  m.def("cpu_backward_threads", [](int64_t batch, int64_t q_len, int64_t kv_len, int64_t q_heads, int64_t head_dim) {
    jaxflash::AttentionShape sh;
    sh.batch = batch;
    sh.q_len = q_len;
    sh.kv_len = kv_len;
    sh.q_heads = q_heads;
    sh.head_dim = head_dim;
    return jaxflash::CpuBackwardThreads(sh);
  });
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
#ifdef JAXFLASH_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
