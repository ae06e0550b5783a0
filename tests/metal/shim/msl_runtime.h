// The emulator's runtime: kernels register by their Metal name, and dispatch() runs one over a
// grid the way a GPU would schedule it, with one OS thread per GPU thread of a threadgroup.
// Stricter than a GPU on purpose: a simd_sum or threadgroup_barrier that not every lane of its
// simdgroup/threadgroup reaches is a deadlock here, reported and aborted after a timeout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "params.h"  // csrc/metal/kernels, on the include path
#include "msl_types.h"

namespace strata_shim {

using namespace metal_shim;

// STRATA_KERNEL_PARAMS with the address-space qualifiers gone.
using KernelFn = void (*)(const KernelParams&, const uint*, const float*, const float*, int*,
                          float*, int*, int*, float*, uint*, float*, float*, float*, const int*,
                          const uint*, atomic_uint*, const uchar*, const uchar*, const uchar*,
                          const uchar*, const uchar*, const uchar*, const uchar*, const uchar*,
                          uint3, uint3, uint, uint);

bool register_kernel(const char* name, KernelFn fn);
KernelFn find_kernel(const std::string& name);  // nullptr when no such kernel
std::vector<std::string> kernel_names();

struct Bindings {
  void* buffer[STRATA_BUF_COUNT] = {};
};

// Runs fn over groups[0] x groups[1] x groups[2] threadgroups of threads[0..2] threads each;
// threadgroups run one after another (x fastest), their threads concurrently.
void dispatch(KernelFn fn, const KernelParams& p, const Bindings& b, const std::uint32_t groups[3],
              const std::uint32_t threads[3]);

}  // namespace strata_shim
