// The pack's layout as a Python dict, every field its header stores or implies: read_layout()
// and ExpertStream.layout give the same one.
#pragma once

#include "bindings.h"
#include "pack/pack_file.h"

namespace strata::python {

py::dict layout_dict(const PackLayout& L);

}  // namespace strata::python
