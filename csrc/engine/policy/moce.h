// moce: cache-aware routing (docs/architecture.md section 6). Given one token's true router ranking and the
// residency the route read from smap, changes which experts the token uses so that more of them
// are already in the arena. Off by default; with it off nothing here runs and routing is exact.
//
//   Scale  resident experts' probabilities are multiplied by `strength` before the top-k (after
//          the true top `keep_top`, which are always kept).
//   Prune  an expert of the true top-k below the true top `keep_top` that is not resident and
//          whose probability is below `strength` is replaced by the best resident expert not
//          already chosen (when there is one); the weakest such picks are replaced first.
//
// The selection is reported in true-rank order, so a token whose set is unchanged gets exactly
// the ids (and, from the route kernel, exactly the weights) it gets with moce off.
#pragma once

#include <cstdint>

namespace strata {

enum class MoceMode : std::uint8_t { Off = 0, Scale = 1, Prune = 2 };

struct MoceParams {
  MoceMode mode = MoceMode::Off;
  float strength = 1.0f;       // Scale: factor on resident probabilities; Prune: threshold
  std::uint32_t keep_top = 2;  // the true top-J always kept (J <= top_k)
};

// What one token's selection changed, against its true top-k.
struct MoceDelta {
  float moved = 0;          // true probability mass of the true top-k experts dropped
  std::uint32_t changed = 0;  // how many of them were dropped (= replaced)
};

// rank: all E experts in true order (probability descending, ties to the lower index).
// prob: true router probabilities (softmax over every expert). resident: per expert, nonzero
// when smap held a slot for it when the route read it. Writes k experts to `selected`, in
// true-rank order. `scratch` holds 2 * E entries.
MoceDelta moce_select(const MoceParams& p, const std::uint32_t* rank, const float* prob,
                      const std::uint32_t* resident, std::uint32_t n_experts, std::uint32_t k,
                      std::uint32_t* selected, std::uint32_t* scratch);

const char* to_string(MoceMode m);

}  // namespace strata
