#pragma once

#include <cstring>
#include <initializer_list>
#include <random>
#include <vector>

#include "exec/window.h"
#include "residency/expert_stream.h"
#include "residency/fault_injection.h"
#include "residency/stream_testing.h"
#include "pack_builder.h"

namespace strata::test {

inline StreamOptions small_options(std::uint32_t slots, const PackLayout& L, std::uint32_t threads) {
  StreamOptions o;
  o.arena_bytes = std::uint64_t(slots) * L.record_stride;
  o.io_threads = threads;
  o.part_bytes = kPage;
  o.direct_io = false;
  o.io_timeout_s = 20;
  return o;
}

// Every part read of these experts stalls `ms` and then reads.
inline void slow_down(ExpertStream& s, const PackLayout& L, std::uint32_t layer,
                      std::initializer_list<std::uint32_t> experts, int ms) {
  for (std::uint32_t e : experts) {
    Fault f;
    f.kind = FaultKind::Delay;
    f.delay_ms = ms;
    f.remaining = -1;
    StreamTesting::faults(s).add(layer * L.n_experts + e, -1, f);
  }
}

// Bytes of a published expert equal the file's record.
inline bool slot_matches(const ExpertStream& s, const TestGeometry& g, std::uint32_t layer,
                         std::uint32_t expert) {
  std::uint32_t slot = s.smap_at(layer * g.n_experts + expert);
  if (slot == kAbsent) return false;
  auto want = expected_record(g, layer, expert);
  return std::memcmp(s.arena().slot(slot), want.data(), want.size()) == 0;
}

// The inputs of an externally routed call of T rows: x, each row's top_k ids and weights.
struct CallRows {
  std::vector<float> x, w;
  std::vector<std::int32_t> ids;
  // The routing a Window's routed call takes (views of ids and w).
  Window::Routed routed() const {
    Window::Routed r;
    r.ids = ids.data();
    r.weights = w.data();
    return r;
  }
};

inline CallRows make_rows(const PackLayout& L, std::uint32_t T, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  CallRows r;
  r.x.resize(std::size_t(T) * L.hidden);
  for (auto& v : r.x) v = nd(rng);
  for (std::uint32_t t = 0; t < T; ++t)
    for (std::uint32_t j = 0; j < L.top_k; ++j) {
      r.ids.push_back(std::int32_t((t * 3 + j * 5 + seed) % L.n_experts));
      r.w.push_back(1.0f / float(j + 1));
    }
  return r;
}

}  // namespace strata::test
