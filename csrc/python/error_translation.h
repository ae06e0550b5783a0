// Engine exceptions as strata_stream.errors (errors.cpp): _core registers the translator for
// every module, strata_stream._bench for its own calls.
#pragma once

#include <exception>

#include "bindings.h"

namespace strata::python {

void translate_engine_errors(std::exception_ptr p);

}  // namespace strata::python
