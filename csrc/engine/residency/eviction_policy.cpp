#include "residency/eviction_policy.h"

namespace strata {

const char* to_string(EvictionPolicy p) {
  switch (p) {
    case EvictionPolicy::Lru: return "lru";
    case EvictionPolicy::DecayedLfu: return "decayed_lfu";
  }
  return "?";
}

std::optional<EvictionPolicy> parse_eviction_policy(std::string_view name) {
  if (name == "lru") return EvictionPolicy::Lru;
  if (name == "decayed_lfu") return EvictionPolicy::DecayedLfu;
  return std::nullopt;
}

}  // namespace strata
