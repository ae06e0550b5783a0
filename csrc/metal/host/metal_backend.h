// The Metal backend's factory (macOS builds only; absent from every other build, so code that
// names it must sit behind STRATA_HAVE_METAL, which csrc/metal/CMakeLists.txt defines where it
// builds the backend).
#pragma once

#include <memory>
#include <string>

#include "exec/backend.h"

namespace strata {

struct MetalBackendOptions {
  // The compiled kernels (strata_kernels.metallib). Empty: beside the binary that holds this
  // code (dladdr), then the kernel source embedded at build time (newLibraryWithSource).
  std::string library_path;
};

// The system default Metal device as a Backend. Throws EngineError(Config) with the reason
// when there is none or it cannot run this backend ("no Metal device", library not found...).
std::unique_ptr<Backend> make_metal_backend(const MetalBackendOptions& options = {});

}  // namespace strata
