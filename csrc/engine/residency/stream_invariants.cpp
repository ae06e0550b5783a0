// The invariant checker: I1 and I3-I7 over the whole slot table, on demand (a testing hook).
#include "residency/expert_stream.h"

#include <sstream>
#include <string>

#include "residency/smap.h"

namespace strata {

std::string ExpertStream::check_invariants() const {
  std::lock_guard<std::mutex> lk(mu_);
  const std::uint32_t K = layout().n_keys();
  std::ostringstream m;
  std::uint32_t limbo = 0;
  for (std::uint32_t key = 0; key < K; ++key) {
    std::uint32_t s = smap_load(smap_.get(), key);
    if (s == kAbsent) continue;
    if (s >= slots_.size()) return "I1: smap[" + std::to_string(key) + "] out of range";
    const Slot& sl = slots_[s];
    if (sl.load() != SlotState::Complete || sl.key != key || !sl.published)
      return "I1: smap[" + std::to_string(key) + "] = " + std::to_string(s) + " but that slot is " +
             to_string(sl.load()) + " holding key " + std::to_string(sl.key);
  }
  for (std::uint32_t s = 0; s < slots_.size(); ++s) {
    const Slot& sl = slots_[s];
    SlotState st = sl.load();
    if (st == SlotState::Limbo) ++limbo;
    if (st == SlotState::Free) {
      if (sl.key != kNoKey || sl.published) return "free slot " + std::to_string(s) + " holds a key";
      continue;
    }
    if (sl.key >= K || where_[sl.key] != std::int32_t(s))
      return "I5: slot " + std::to_string(s) + " and where_ disagree";
    if (sl.published != (smap_load(smap_.get(), sl.key) == s))
      return "I1: slot " + std::to_string(s) + " published flag disagrees with smap";
    if (st == SlotState::Limbo && sl.published) return "I7: limbo slot published";
  }
  for (std::uint32_t key = 0; key < K; ++key) {
    std::int32_t s = where_[key];
    if (s >= 0 && slots_[std::uint32_t(s)].key != key)
      return "where_[" + std::to_string(key) + "] points at a slot holding another key";
  }
  if (limbo != limbo_.size()) return "limbo list drifted";
  return "";
}

}  // namespace strata
