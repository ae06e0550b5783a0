// The seam between strata_stream._core and strata_stream._cuda. _cuda is its own extension
// module, so importing strata_stream never needs a CUDA runtime; it hands _core this table in
// a PyCapsule named kFactoryCapsule. Only header-only engine types cross it (Backend and what
// its methods take: DeviceBuffers, Command, PackLayout, Capability, DeviceIo, SharedEvent),
// each side compiled from the same headers with the same compiler; the ABI number and the
// sizes below catch a _cuda built from other ones.
#pragma once

#include <cstdint>
#include <string>

#include "exec/backend.h"

namespace strata::cuda {

constexpr const char* kFactoryCapsule = "strata_stream._cuda.factory";
// 2: Backend::unsupported(Capability), submit by reference. 3: Capability::io,
// Backend::set_device_io (routed calls on the caller's device memory). 4:
// Backend::record_observer (the device copy at IO completion). 5: Backend::host_spin. 6:
// Command::queued, DeviceIo::ordered and ::stream, Backend::completes_async (a routed call
// returning before its kernels finish, the caller's stream waiting for them).
constexpr std::uint32_t kFactoryAbi = 6;

struct BackendFactory {
  std::uint32_t abi = kFactoryAbi;
  std::uint32_t sizeof_buffers = sizeof(DeviceBuffers);
  std::uint32_t sizeof_command = sizeof(Command);
  std::uint32_t sizeof_layout = sizeof(PackLayout);
  std::uint32_t sizeof_capability = sizeof(Capability);
  // Why no CUDA device can run the backend here ("" when one can): no driver, no GPU.
  std::string (*unavailable)() = nullptr;
  // A new backend on device 0, or null with *why set.
  Backend* (*make)(std::string* why) = nullptr;
};

// Whether a factory from another module was built against these headers.
inline bool factory_matches(const BackendFactory& f) {
  return f.abi == kFactoryAbi && f.sizeof_buffers == sizeof(DeviceBuffers) &&
         f.sizeof_command == sizeof(Command) && f.sizeof_layout == sizeof(PackLayout) &&
         f.sizeof_capability == sizeof(Capability) &&
         f.unavailable && f.make;
}

}  // namespace strata::cuda
