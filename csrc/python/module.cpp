// strata_stream._core: the pybind11 face of the engine, one binding file per concept
// (bindings.h). The order matters only where one concept names another's type: Window takes
// a Stream, the testing hooks and the replay take a Stream.
#include "bindings.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "strata-stream engine (C++)";
  using namespace strata::python;
  init_errors(m);
  init_pack(m);
  init_stream(m);
  init_backends(m);
  init_window(m);
  init_testing(m);
  init_replay(m);
}
