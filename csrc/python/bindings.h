// The pieces of strata_stream._core, one per concept (module.cpp puts them together in order).
// Every binding file is thin on purpose: argument conversion, GIL release around every wait,
// and engine errors mapped onto strata_stream.errors (errors.cpp). Ranges against the pack
// (layer, expert ids, max_rows) are the engine's to check: it is the boundary that C++ callers
// and these bindings both pass, so each check is written once, with one message, there.
#pragma once

#include <pybind11/pybind11.h>

namespace strata::python {

namespace py = pybind11;

void init_errors(py::module_& m);   // errors.cpp: engine exceptions -> strata_stream.errors
void init_pack(py::module_& m);     // pack.cpp: pack layout, CRC32C
void init_stream(py::module_& m);   // stream.cpp: ExpertStream, ReadClass, SlotState, ABSENT
void init_backends(py::module_& m);  // backends.cpp: the backend registry (register_backend)
void init_window(py::module_& m);   // window.cpp: WindowOptions, Window (the layer calls)
void init_testing(py::module_& m);  // testing.cpp: the `testing` submodule (test hooks)
void init_replay(py::module_& m);   // replay.cpp: a routing trace through a Window, computing nothing

}  // namespace strata::python
