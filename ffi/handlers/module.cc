// The extension module: hands the FFI handlers to Python as capsules, and says
// how it was built so Python can refuse a build that would not load.
#include <nanobind/nanobind.h>

#include "handlers.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace {

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

using Handler = XLA_FFI_Error*(XLA_FFI_CallFrame*);

// One platform's targets: forward, paged forward and backward, each at v2
// (v1 + the softcap attribute) and at v1, kept for programs exported before it.
nb::dict Targets(Handler* fwd, Handler* paged, Handler* bwd, Handler* fwd_v1, Handler* paged_v1,
                 Handler* bwd_v1) {
  nb::dict d;
  d["jaxflash_fwd_v2"] = Capsule(fwd);
  d["jaxflash_paged_fwd_v2"] = Capsule(paged);
  d["jaxflash_bwd_v2"] = Capsule(bwd);
  d["jaxflash_fwd_v1"] = Capsule(fwd_v1);
  d["jaxflash_paged_fwd_v1"] = Capsule(paged_v1);
  d["jaxflash_bwd_v1"] = Capsule(bwd_v1);
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
    return Targets(JaxflashCpuForward, JaxflashCpuPagedForward, JaxflashCpuBackward, JaxflashCpuForwardV1,
                   JaxflashCpuPagedForwardV1, JaxflashCpuBackwardV1);
  });
  m.def("cuda_targets", [] {
#ifdef JAXFLASH_WITH_CUDA
    return Targets(JaxflashCudaForward, JaxflashCudaPagedForward, JaxflashCudaBackward, JaxflashCudaForwardV1,
                   JaxflashCudaPagedForwardV1, JaxflashCudaBackwardV1);
#else
    return nb::dict();
#endif
  });
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
#ifdef JAXFLASH_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
