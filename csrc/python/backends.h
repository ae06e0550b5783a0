// Bindings of the backend registry (backends.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace strata::python {

void bind_backends(pybind11::module_& m);

}  // namespace strata::python
