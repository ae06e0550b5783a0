// Bindings: the backend registry (exec/backend_registry.h). Registers the backends built into
// this extension, and lets another extension register its own by name at run time.
#include "bindings.h"

#include <pybind11/stl.h>

#include "common/errors.h"
#include "exec/backend_registry.h"

#ifdef STRATA_HAVE_METAL
#include "metal_backend.h"
#endif

namespace strata::python {
namespace {

#ifdef STRATA_HAVE_METAL
std::unique_ptr<Backend> metal_factory(const BackendOptions& o) {
  MetalBackendOptions m;
  m.library_path = o.library_path;
  return make_metal_backend(m);
}
#endif

}  // namespace

void init_backends(py::module_& m) {
#ifdef STRATA_HAVE_METAL
  register_backend("metal", &metal_factory);
#endif
  m.def(
      "register_backend",
      [](const std::string& name, py::capsule factory) {
        if (std::string(factory.name() ? factory.name() : "") != kBackendFactoryCapsule)
          throw EngineError(ErrorKind::Config, std::string("register_backend needs a capsule named ") +
                                                   kBackendFactoryCapsule);
        register_backend(name, reinterpret_cast<BackendFactory>(factory.get_pointer()));
      },
      py::arg("name"), py::arg("factory"),
      "Registers a backend factory another extension exports (a PyCapsule named "
      "'strata_stream.BackendFactory'), so that Window(stream, backend=name) makes it.");
  m.def("backend_names", &backend_names, "The backends this process can make, cpu first.");
}

}  // namespace strata::python
