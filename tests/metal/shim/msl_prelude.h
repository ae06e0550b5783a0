// The small subset of the Metal Shading Language the kernels use, expressed in C++20 so the
// same .metal sources compile on Linux in two modes:
//
//  STRATA_MSL_TYPECHECK (clang only, -fsyntax-only): device, threadgroup and constant become
//    distinct clang address spaces, so a pointer used in the wrong address space is a compile
//    error exactly as it is for the Metal compiler (tests/metal/test_typecheck.py proves it).
//  otherwise (the emulator, any C++20 compiler): address-space qualifiers vanish and the
//    SIMD-group builtins run on the shim runtime (msl_runtime.h): one OS thread per GPU thread,
//    an exchange per simdgroup for simd_sum, a barrier per threadgroup for threadgroup_barrier.
//
// Anything outside this subset fails to compile here; tests/metal/test_msl_subset.py also
// rejects it by name, so a kernel cannot quietly depend on a builtin the shim does not model.
#pragma once

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>

#include "msl_types.h"

#ifdef STRATA_MSL_TYPECHECK
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2))) const
#define threadgroup __attribute__((address_space(3)))
#else
#define device
#define constant const
#define threadgroup
#endif
#define thread

namespace metal_shim {

#ifdef STRATA_MSL_TYPECHECK
// Declarations only: the type-check never links.
float simd_sum(float v);
void threadgroup_barrier(mem_flags f);
void atomic_store_explicit(device atomic_uint* a, uint v, std::memory_order o);
uint atomic_load_explicit(device atomic_uint* a, std::memory_order o);
#else
float simd_sum(float v);                  // msl_runtime.cpp
void threadgroup_barrier(mem_flags f);    // msl_runtime.cpp
inline void atomic_store_explicit(atomic_uint* a, uint v, std::memory_order o) { a->store(v, o); }
inline uint atomic_load_explicit(atomic_uint* a, std::memory_order o) { return a->load(o); }
#endif

}  // namespace metal_shim

using namespace metal_shim;
