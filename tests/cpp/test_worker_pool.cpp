// The CPU backend's worker pool: every index runs exactly once, whoever runs it; a join never
// leaves a chunk behind; a worker that wakes late cannot touch a run that is over (its job
// lives on the caller's stack here, so ASan and TSan in CI see any late use).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <thread>
#include <vector>

#include "cpu/worker_pool.h"

using strata::cpu::WorkerPool;

namespace {

// Runs [0, n) and checks each index was visited exactly once.
void run_and_check(WorkerPool& pool, std::uint32_t n, bool slow_workers) {
  std::vector<std::atomic<int>> seen(n);
  std::atomic<int> bad_chunks{0};  // Catch2's REQUIRE is not for other threads: count, check after
  const auto caller = std::this_thread::get_id();
  const WorkerPool::Job job = [&](std::uint32_t a, std::uint32_t b) {
    if (!(a < b && b <= n)) {
      bad_chunks.fetch_add(1);
      return;
    }
    // A worker that is slow inside its chunk: the join must still wait for that chunk.
    if (slow_workers && std::this_thread::get_id() != caller) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    for (std::uint32_t i = a; i < b; ++i) seen[i].fetch_add(1, std::memory_order_relaxed);
  };
  pool.run(n, job);
  REQUIRE(bad_chunks.load() == 0);
  for (std::uint32_t i = 0; i < n; ++i) REQUIRE(seen[i].load() == 1);
}

}  // namespace

TEST_CASE("worker pool: every index exactly once, at every size and pool width") {
  for (unsigned workers : {0u, 1u, 3u}) {
    WorkerPool pool(workers);
    REQUIRE(pool.workers() == workers);
    for (std::uint32_t n : {0u, 1u, 2u, 7u, 16u, 17u, 1000u, 4099u}) {
      run_and_check(pool, n, false);
      run_and_check(pool, n, true);
    }
  }
}

TEST_CASE("worker pool: back-to-back runs with jobs on the caller's stack") {
  // Many short runs in a row: a worker still waking for run i must neither run run i's job
  // after it returned (its std::function is gone) nor miss run i+1's chunks.
  WorkerPool pool(2);
  std::uint64_t total = 0;
  for (int r = 0; r < 3000; ++r) {
    std::atomic<std::uint64_t> sum{0};
    const std::uint32_t n = 1 + std::uint32_t(r % 37);
    {
      const WorkerPool::Job job = [&sum](std::uint32_t a, std::uint32_t b) {
        for (std::uint32_t i = a; i < b; ++i) sum.fetch_add(i + 1, std::memory_order_relaxed);
      };
      pool.run(n, job);
    }
    REQUIRE(sum.load() == std::uint64_t(n) * (n + 1) / 2);
    total += sum.load();
  }
  REQUIRE(total > 0);
}
