// The testing seam of ExpertStream: hooks that tests need and the product does not (manual IO,
// fault injection, the invariant checker, forced eviction). Kept off the public class so that
// no caller of the engine reaches them by accident; the Python tests reach them through
// strata_stream's testing module, the C++ tests directly.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "residency/expert_stream.h"
#include "residency/fault_injection.h"

namespace strata {

struct JobInfo {
  std::uint32_t slot, key, part;
  ReadClass cls;
};

struct StreamTesting {
  // Manual IO (io_threads == 0): the queued part reads in priority order, and running one.
  static std::vector<JobInfo> pending_jobs(const ExpertStream& s) { return s.pending_jobs(); }
  static bool run_job(ExpertStream& s, std::size_t index) { return s.run_job(index); }
  // Failing, slow or held reads on chosen parts (fault_injection.h).
  static FaultInjector& faults(ExpertStream& s) { return *s.faults_; }
  // I1, I3-I7 over the whole slot table: "" or the first violation.
  static std::string check_invariants(const ExpertStream& s) { return s.check_invariants(); }
  // The slot eviction would pick now (-1: none), and evicting it.
  static std::int32_t victim(const ExpertStream& s, bool speculative = false) {
    return s.victim(speculative);
  }
  static std::int32_t evict_one(ExpertStream& s) { return s.evict_one(); }
};

}  // namespace strata
