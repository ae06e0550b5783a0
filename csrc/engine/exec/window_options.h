// WindowOptions: a Window's configuration, checked once (validate), and what its parts take of
// it: the plan's rules (chunk_plan.h) and the Speculator's options (speculator.h). With
// validate(StreamOptions) these are the engine's one range check of every setting: Python's
// StreamConfig fills both structs through the bindings and asks them (docs/settings.md). The
// field names are StreamConfig's, and each setting's environment variable is STRATA_<NAME>.
#pragma once

#include <cstdint>

#include "exec/backend.h"
#include "exec/chunk_plan.h"
#include "exec/speculator.h"
#include "policy/moce.h"
#include "policy/prefetch_governor.h"
#include "residency/expert_stream.h"

namespace strata {

// The most new l+2 reads a handshake may start (two_layer_max); StreamConfig clamps to it.
constexpr std::uint32_t kTwoLayerMaxLimit = 512;

struct WindowOptions {
  bool lookahead = true;  // router l+1 on layer l's input, in prompt and decode
  // Two-layer lookahead: router l+2 on layer l's input too, for decode-sized chunks
  // (two_layer_decode; the seed's STRATA_METAL_PREFETCH2) and for larger ones
  // (two_layer_prompt; STRATA_METAL_PROMPT_PRED2), on every path.
  bool two_layer_decode = false;
  bool two_layer_prompt = false;
  // New l+2 reads per handshake, 0..kTwoLayerMaxLimit (STRATA_METAL_PROMPT_PRED2_MAX).
  std::uint32_t two_layer_max = 64;
  // Keep the prompt scratch (and the backend's views of it) across turns instead of releasing
  // it when a turn ends (STRATA_METAL_PROMPT_BUF_REUSE).
  bool prompt_buf_reuse = false;
  bool record_routes = false;  // keep (token, layer, expert) of every routed choice
  // At turn start, queue profile-ranked experts of layers 0..n-1 (layer 0 up to top_k of
  // them, later layers up to 32 new reads each) (STRATA_METAL_PROMPT_START_LAYERS).
  std::uint32_t start_layers = 1;
  // With lookahead off, the handshake of layer l queues layer l+1's most popular experts by the
  // profile as Profile reads (docs/architecture.md section 6).
  bool profile_prefetch = true;
  // A PrefetchGovernor caps the speculative reads each handshake starts when they do not pay;
  // off, the cap is always unlimited.
  bool prefetch_backoff = true;
  GovernorOptions governor;
  bool split_turn = false;        // each step its own submission (host works between them)
  std::uint32_t max_rows = 1024;  // prompt chunk rows (MT)
  std::uint32_t decode_rows = 4;  // T <= this (and its experts fit) takes the decode path
  // An externally routed call of up to this many rows (B sequences decoding together) takes the
  // decode path while the union of its rows' experts fits one decode submission: the ids are
  // known before the submission, so the bound is the union, not rows * top_k.
  std::uint32_t decode_batch_rows = 64;
  double device_timeout_s = 600;  // bound on any single wait for the device
  // Cache-aware routing (moce, moce_strength, moce_keep_top): adjusts the routed selection by
  // residency (moce.h).
  MoceParams moce;

  // EngineError(Config) naming the first field out of range: validate() what holds for any
  // pack, validate(layout) that and what depends on the pack (moce_keep_top <= top_k);
  // validated() returns the options once they pass.
  void validate() const;
  void validate(const PackLayout& layout) const;
  const WindowOptions& validated(const PackLayout& layout) const {
    validate(layout);
    return *this;
  }
  PlanRules plan_rules(const PackLayout& layout) const;
  SpeculatorOptions speculation() const;
};

// EngineError(Config) naming the first StreamOptions field out of range. It lives here, beside
// WindowOptions::validate, so that one file holds every range check of a setting.
void validate(const StreamOptions& o);

// What a Window's own route needs of its backend (moce), for choosing one (make_backend).
Capability route_capability(const PackLayout& layout, const MoceParams& moce);

}  // namespace strata
