// _core's side of the CUDA backend: strata_stream._cuda, imported on demand (with the GIL), hands
// over its factory in a capsule (csrc/cuda/host/factory.h). Where the build has no _cuda, or
// _cuda was built from other engine headers, the factory is null and `why` says so.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>

#include "../cuda/host/factory.h"
#include "common/errors.h"

namespace strata::python {

inline const cuda::BackendFactory* load_cuda_factory(std::string* why) {
  namespace py = pybind11;
  try {
    py::module_ m = py::module_::import("strata_stream._cuda");
    py::capsule cap = m.attr("factory").cast<py::capsule>();
    const char* name = cap.name();
    if (!name || std::string(name) != cuda::kFactoryCapsule) {
      *why = "strata_stream._cuda exports no backend factory";
      return nullptr;
    }
    const auto* f = cap.get_pointer<const cuda::BackendFactory>();
    if (!f || !cuda::factory_matches(*f)) {
      *why = "strata_stream._cuda was built from other engine headers than _core; rebuild both";
      return nullptr;
    }
    return f;
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_ImportError)) throw;
    *why = "this build of strata_stream has no CUDA backend (built without nvcc, or with "
           "STRATA_CUDA=OFF)";
    return nullptr;
  }
}

}  // namespace strata::python

namespace strata::python {

// The factory lookup's outcome, taken with the GIL before a Window is built without it.
struct CudaFactory {
  const cuda::BackendFactory* factory = nullptr;
  std::string why;  // why there is none
  static CudaFactory load() {
    CudaFactory c;
    c.factory = load_cuda_factory(&c.why);
    return c;
  }
  // "" when a GPU can run the backend here, else why not.
  std::string unavailable() const { return factory ? factory->unavailable() : why; }
  // A CUDA backend, or EngineError(Config) naming why there is none.
  std::unique_ptr<Backend> make(bool moce_on) const {
    if (moce_on)
      throw EngineError(ErrorKind::Config,
                        "backend 'cuda' does not implement cache-aware routing (moce); use "
                        "backend 'cpu' or moce 'off'");
    std::string no = unavailable();
    if (!no.empty()) throw EngineError(ErrorKind::Config, "backend 'cuda' is unavailable: " + no);
    std::string err;
    Backend* b = factory->make(&err);
    if (!b) throw EngineError(ErrorKind::Config, "backend 'cuda' could not start: " + err);
    return std::unique_ptr<Backend>(b);
  }
};

}  // namespace strata::python
