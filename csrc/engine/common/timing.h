// Clocks for the engine's own statistics: wall time since a point, and the calling thread's CPU
// time (what host work costs, apart from the time the scheduler gives other threads).
#pragma once

#include <chrono>
#include <cstdint>
#include <ctime>

namespace strata {

using Clock = std::chrono::steady_clock;

inline std::uint64_t ns_since(Clock::time_point t0) {
  return std::uint64_t(
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
}

inline std::uint64_t ns_between(Clock::time_point t0, Clock::time_point t1) {
  return std::uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
}

inline std::uint64_t thread_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return std::uint64_t(ts.tv_sec) * 1000000000ull + std::uint64_t(ts.tv_nsec);
}

}  // namespace strata
