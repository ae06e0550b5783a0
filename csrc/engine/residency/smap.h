// The slot map's one access rule, shared by the host (ExpertStream) and the CPU device
// (cpu_kernels): every element is read and written through std::atomic_ref, release on store and
// acquire on load, so a device thread reading smap while the host publishes is race-free and
// sees a slot's bytes once it sees the slot.
#pragma once

#include <atomic>
#include <cstdint>

namespace strata {

inline void smap_store(std::uint32_t* smap, std::uint32_t key, std::uint32_t v) {
  std::atomic_ref<std::uint32_t>(smap[key]).store(v, std::memory_order_release);
}

inline std::uint32_t smap_load(const std::uint32_t* smap, std::uint32_t key) {
  return std::atomic_ref<const std::uint32_t>(smap[key]).load(std::memory_order_acquire);
}

}  // namespace strata
