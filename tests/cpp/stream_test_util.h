#pragma once

#include <cstring>
#include <vector>

#include "residency/expert_stream.h"
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

// Bytes of a published expert equal the file's record.
inline bool slot_matches(const ExpertStream& s, const TestGeometry& g, std::uint32_t layer,
                         std::uint32_t expert) {
  std::uint32_t slot = s.smap_at(layer * g.n_experts + expert);
  if (slot == kAbsent) return false;
  auto want = expected_record(g, layer, expert);
  return std::memcmp(s.arena().slot(slot), want.data(), want.size()) == 0;
}

}  // namespace strata::test
