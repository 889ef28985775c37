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

}  // namespace

// The target names carry the version of their interface: operands, results and
// attributes (params.h's order and meaning). A program exported with
// jax.export records the names, so a change to any of them is a new version
// registered beside the old one, never an edit of a shipped one; the Python
// side names them in jaxflash/_native.py (TARGETS).
NB_MODULE(_jaxflash, m) {
  m.doc() = "jaxflash FFI handlers";
  m.def("cpu_targets", [] {
    nb::dict d;
    d["jaxflash_fwd_v2"] = Capsule(JaxflashCpuForward);  // v1 + softcap
    d["jaxflash_paged_fwd_v2"] = Capsule(JaxflashCpuPagedForward);
    d["jaxflash_bwd_v2"] = Capsule(JaxflashCpuBackward);
    d["jaxflash_fwd_v1"] = Capsule(JaxflashCpuForwardV1);
    d["jaxflash_paged_fwd_v1"] = Capsule(JaxflashCpuPagedForwardV1);
    d["jaxflash_bwd_v1"] = Capsule(JaxflashCpuBackwardV1);
    return d;
  });
  m.def("cuda_targets", [] {
    nb::dict d;
#ifdef JAXFLASH_WITH_CUDA
    d["jaxflash_fwd_v2"] = Capsule(JaxflashCudaForward);  // v1 + softcap
    d["jaxflash_paged_fwd_v2"] = Capsule(JaxflashCudaPagedForward);
    d["jaxflash_bwd_v2"] = Capsule(JaxflashCudaBackward);
    d["jaxflash_fwd_v1"] = Capsule(JaxflashCudaForwardV1);
    d["jaxflash_paged_fwd_v1"] = Capsule(JaxflashCudaPagedForwardV1);
    d["jaxflash_bwd_v1"] = Capsule(JaxflashCudaBackwardV1);
#endif
    return d;
  });
  m.attr("ffi_api_version") = nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR);
#ifdef JAXFLASH_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
