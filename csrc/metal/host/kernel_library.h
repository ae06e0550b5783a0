// Where the compiled kernels come from: strata_kernels.metallib (xcrun metal + metallib at build
// time, installed beside the extension), else the kernel source embedded in the binary at build
// time, compiled by the driver (slower first start, same source).
#pragma once

#include <string>

namespace MTL {
class Device;
class Library;
}  // namespace MTL

namespace strata::metal {

// A retained library. `how` says which source was used (for logs and error messages). Throws
// EngineError(Config) when neither works, with both reasons.
MTL::Library* load_kernel_library(MTL::Device* device, const std::string& explicit_path,
                                  std::string* how);

}  // namespace strata::metal
