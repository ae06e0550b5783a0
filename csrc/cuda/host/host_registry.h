// Host memory mapped into the GPU (cudaHostRegister, mapped). One process-wide table with a
// reference count per range, because several Windows (several backends) share one stream's
// arena and slot map and the driver registers a range once.
#pragma once

#include <cstddef>
#include <string>

namespace strata::cuda {

// Registers [p, p + bytes) mapped (once per process; counted) and returns its device address,
// or null with *why set.
void* map_host(const void* p, std::size_t bytes, std::string* why);
// Drops one reference; the last unregisters the range.
void unmap_host(const void* p);

}  // namespace strata::cuda
