// strata_stream._cuda: the CUDA backend as an extension module of its own, so that importing
// strata_stream never needs a CUDA runtime. It links the CUDA runtime statically (the driver is
// loaded when first used) and exports the backend factory to _core in a capsule (host/factory.h).
#include <pybind11/pybind11.h>

#include "host/bf16_families.h"
#include "host/cuda_backend.h"
#include "host/factory.h"
#include "kernels/wgmma_experts.h"

namespace py = pybind11;

namespace {

strata::Backend* make(std::string* why) {
  try {
    return strata::cuda::make_cuda_backend().release();
  } catch (const std::exception& e) {
    *why = e.what();
    return nullptr;
  }
}

const strata::cuda::BackendFactory kFactory = [] {
  strata::cuda::BackendFactory f;
  f.unavailable = &strata::cuda::unavailable;
  f.make = &make;
  return f;
}();

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "strata-stream CUDA backend (loaded by strata_stream._core for backend='cuda')";
  m.attr("factory") = py::capsule(const_cast<strata::cuda::BackendFactory*>(&kFactory),
                                  strata::cuda::kFactoryCapsule);
  m.def("unavailable", &strata::cuda::unavailable,
        "Why no CUDA GPU can run the backend here; '' when one can.");
  m.def("wgmma_unavailable", &strata::cuda::wgmma_unavailable,
        "Why the bf16 kernels cannot run on Hopper's wgmma here (STRATA_CUDA_BF16=wgmma); '' "
        "when they can.");
  m.def("bf16_family", &strata::cuda::bf16_family_description,
        "Which instruction family the bf16 passes take on this GPU (STRATA_CUDA_BF16: auto, the "
        "default, mma or wgmma), in words; where auto fell back to mma.sync, why.");
}
