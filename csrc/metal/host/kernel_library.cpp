#include "kernel_library.h"

#include <dlfcn.h>

#include <Metal/Metal.hpp>

#include "common/errors.h"

// Generated at build time from csrc/metal/kernels (csrc/metal/CMakeLists.txt): every header
// and .metal file concatenated in dependency order, local #includes removed.
extern "C" const char strata_metal_kernel_source[];

namespace strata::metal {
namespace {

std::string beside_this_binary(const char* file) {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&load_kernel_library), &info) == 0 || !info.dli_fname)
    return "";
  std::string path = info.dli_fname;
  const auto slash = path.rfind('/');
  return (slash == std::string::npos ? std::string(".") : path.substr(0, slash)) + "/" + file;
}

std::string describe(NS::Error* err) {
  if (!err || !err->localizedDescription()) return "unknown error";
  return err->localizedDescription()->utf8String();
}

}  // namespace

MTL::Library* load_kernel_library(MTL::Device* device, const std::string& explicit_path,
                                  std::string* how) {
  const std::string path =
      explicit_path.empty() ? beside_this_binary("strata_kernels.metallib") : explicit_path;
  std::string file_error = "no path";
  if (!path.empty()) {
    NS::Error* err = nullptr;
    MTL::Library* lib =
        device->newLibrary(NS::String::string(path.c_str(), NS::UTF8StringEncoding), &err);
    if (lib) {
      *how = "metallib " + path;
      return lib;
    }
    file_error = path + ": " + describe(err);
  }
  NS::Error* err = nullptr;
  MTL::CompileOptions* options = MTL::CompileOptions::alloc()->init();
  options->setFastMathEnabled(false);  // as the metallib is built: -fno-fast-math
  MTL::Library* lib = device->newLibrary(
      NS::String::string(strata_metal_kernel_source, NS::UTF8StringEncoding), options, &err);
  options->release();
  if (lib) {
    *how = "embedded source (" + file_error + ")";
    return lib;
  }
  throw EngineError(ErrorKind::Config, "Metal backend: cannot load the kernels: " + file_error +
                                           "; embedded source: " + describe(err));
}

}  // namespace strata::metal
