// The scalar and vector types of the MSL subset, as plain C++ (no address-space macros), so the
// emulator runtime and the kernels agree on them without the runtime seeing the macros.
#pragma once

#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>

namespace metal_shim {

using uint = std::uint32_t;
using ushort = std::uint16_t;
using uchar = std::uint8_t;
using ulong = std::uint64_t;
using half = _Float16;

struct uint3 {
  uint x, y, z;
};

using atomic_uint = std::atomic<uint>;
using std::memory_order_relaxed;

template <class To, class From>
inline To as_type(From v) {
  static_assert(sizeof(To) == sizeof(From), "as_type reinterprets equal-sized values");
  return std::bit_cast<To>(v);
}

inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
inline float exp(float v) { return std::exp(v); }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline float clamp(float v, float lo, float hi) { return std::fmin(std::fmax(v, lo), hi); }
inline uint min(uint a, uint b) { return a < b ? a : b; }

enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };

}  // namespace metal_shim
