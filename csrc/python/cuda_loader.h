// _core's side of the CUDA backend: strata_stream._cuda, imported on demand (with the GIL), hands
// over its factory in a capsule (csrc/cuda/host/factory.h). Where the build has no _cuda, or
// _cuda was built from other engine headers, the factory is null and `why` says so.
#pragma once

#include <pybind11/pybind11.h>

#include <atomic>
#include <memory>
#include <string>

#include "../cuda/host/factory.h"
#include "common/errors.h"
#include "exec/backend_registry.h"

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

// The CUDA backend in the registry (exec/backend_registry.h): every Window that may want it
// (backend "cuda" or "auto") looks for strata_stream._cuda, with the GIL, until it has loaded
// once; from then on its factory is registered as "cuda". Where it is missing or no GPU can run
// it, "cuda" stays unregistered ("auto" then takes another backend) and `required`
// (backend="cuda") raises ConfigError naming why.
inline std::atomic<const cuda::BackendFactory*>& cuda_factory_slot() {
  static std::atomic<const cuda::BackendFactory*> f{nullptr};
  return f;
}

inline std::unique_ptr<Backend> make_cuda_backend(const BackendOptions&) {
  const cuda::BackendFactory* f = cuda_factory_slot().load(std::memory_order_acquire);
  std::string err;
  Backend* b = f ? f->make(&err) : nullptr;
  if (!b) throw EngineError(ErrorKind::Config, "backend 'cuda' could not start: " + err);
  return std::unique_ptr<Backend>(b);
}

inline void register_cuda_backend(bool required) {
  if (!cuda_factory_slot().load(std::memory_order_acquire)) {
    std::string why;
    const cuda::BackendFactory* f = load_cuda_factory(&why);
    if (f) why = f->unavailable();
    if (!f || !why.empty()) {
      if (required) throw EngineError(ErrorKind::Config, "backend 'cuda' is unavailable: " + why);
      return;
    }
    cuda_factory_slot().store(f, std::memory_order_release);
  }
  register_backend("cuda", &make_cuda_backend);  // registering it again is a no-op
}

}  // namespace strata::python
