// Always-on counters. Relaxed atomics: each is an independent tally, read as a snapshot for
// reporting; nothing synchronizes through them.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <string>

namespace strata {

struct StreamStats {
  std::atomic<std::uint64_t> hits{0};            // urgent request found the expert resident/loading
  std::atomic<std::uint64_t> misses{0};          // urgent request had to start a read
  std::atomic<std::uint64_t> spec_requests{0};   // speculative reads started
  std::atomic<std::uint64_t> spec_hits{0};       // urgent request served by a speculative read
  std::atomic<std::uint64_t> spec_dropped{0};    // speculative request found no space (I9)
  std::atomic<std::uint64_t> spec_failed{0};     // speculative read failed and was dropped
  std::atomic<std::uint64_t> failed{0};          // urgent read failures reported to the caller
  std::atomic<std::uint64_t> bytes_read{0};
  std::atomic<std::uint64_t> reads_completed{0};  // records fully read
  std::atomic<std::uint64_t> read_ns{0};          // sum over IO threads of time inside pread
  // Where the rest of an IO thread's time goes (benchmarks/io_path.py splits it with these):
  // the parts' CRC32C and the record's check (verify_reads), the record observers (a backend's
  // device copy), and every part job from its pop to its end, locks and wakes included, so
  // job - read - crc - observer is the IO path's own bookkeeping; job_cpu_ns is the CPU time
  // the IO threads were given for those jobs (from a warm page cache a pread is CPU work too,
  // so job - job_cpu is time spent blocked on a lock or off a busy core).
  std::atomic<std::uint64_t> crc_ns{0};
  std::atomic<std::uint64_t> observer_ns{0};
  std::atomic<std::uint64_t> job_ns{0};
  std::atomic<std::uint64_t> job_cpu_ns{0};
  std::atomic<std::uint64_t> stall_ns{0};         // host time blocked in wait()
  // Where a miss's time goes, summed over the reads urgent from their start that were published
  // (miss_timed of them): queued to its first part's start (the IO threads' wake), first part's
  // start to the completing part's pread end (the reads), that to the record observers' return
  // (the part's CRC and observers, the record's check and observers: a backend's device copies),
  // that to publication. A lone miss's wait() less these is its waiter's wake.
  std::atomic<std::uint64_t> miss_timed{0};
  std::atomic<std::uint64_t> miss_queued_ns{0};
  std::atomic<std::uint64_t> miss_read_ns{0};
  std::atomic<std::uint64_t> miss_finish_ns{0};
  std::atomic<std::uint64_t> miss_publish_ns{0};
  std::atomic<std::uint64_t> cancelled{0};
  std::atomic<std::uint64_t> limbo{0};            // slots parked in limbo
  std::atomic<std::uint64_t> limbo_released{0};
  std::atomic<std::uint64_t> published{0};        // speculative slots published at a handshake
  std::atomic<std::uint64_t> evicted{0};
  std::atomic<std::uint64_t> revived{0};          // limbo slots taken back by a request
  // Part reads of speculative classes begun and ended: their difference is how many are in
  // flight, which the prefetch governor samples around an urgent wait (did urgent work share
  // the SSD with speculation?).
  std::atomic<std::uint64_t> spec_parts_started{0};
  std::atomic<std::uint64_t> spec_parts_done{0};

  std::map<std::string, double> snapshot() const {
    auto g = [](const std::atomic<std::uint64_t>& a) { return double(a.load(std::memory_order_relaxed)); };
    return {{"hits", g(hits)},
            {"misses", g(misses)},
            {"spec_requests", g(spec_requests)},
            {"spec_hits", g(spec_hits)},
            {"spec_dropped", g(spec_dropped)},
            {"spec_failed", g(spec_failed)},
            {"failed", g(failed)},
            {"bytes_read", g(bytes_read)},
            {"reads_completed", g(reads_completed)},
            {"read_seconds", g(read_ns) * 1e-9},
            {"crc_seconds", g(crc_ns) * 1e-9},
            {"observer_seconds", g(observer_ns) * 1e-9},
            {"io_job_seconds", g(job_ns) * 1e-9},
            {"io_job_cpu_seconds", g(job_cpu_ns) * 1e-9},
            {"stall_seconds", g(stall_ns) * 1e-9},
            {"miss_timed", g(miss_timed)},
            {"miss_queued_seconds", g(miss_queued_ns) * 1e-9},
            {"miss_read_seconds", g(miss_read_ns) * 1e-9},
            {"miss_finish_seconds", g(miss_finish_ns) * 1e-9},
            {"miss_publish_seconds", g(miss_publish_ns) * 1e-9},
            {"cancelled", g(cancelled)},
            {"limbo", g(limbo)},
            {"limbo_released", g(limbo_released)},
            {"published", g(published)},
            {"evicted", g(evicted)},
            {"revived", g(revived)},
            {"spec_parts_started", g(spec_parts_started)},
            {"spec_parts_done", g(spec_parts_done)}};
  }
};

}  // namespace strata
