// WindowOptions: a Window's configuration, checked once (validate), and what its parts take of
// it: the plan's rules (chunk_plan.h) and the Speculator's options (speculator.h).
#pragma once

#include <cstdint>

#include "exec/backend.h"
#include "exec/chunk_plan.h"
#include "exec/speculator.h"
#include "policy/moce.h"
#include "policy/prefetch_governor.h"

namespace strata {

struct WindowOptions {
  bool lookahead = true;  // router l+1 on layer l's input, in prompt and decode
  // Two-layer lookahead: router l+2 on layer l's input too, for decode-sized chunks
  // (STRATA_METAL_PREFETCH2) and for larger ones (STRATA_METAL_PROMPT_PRED2), on every path.
  bool two_layer_decode = false;
  bool two_layer_prompt = false;
  std::uint32_t two_layer_max = 64;  // STRATA_METAL_PROMPT_PRED2_MAX: new l+2 reads per handshake
  // STRATA_METAL_PROMPT_BUF_REUSE: keep the prompt scratch (and the backend's views of it)
  // across turns instead of releasing it when a turn ends.
  bool prompt_buf_reuse = false;
  bool record_routes = false;  // keep (token, layer, expert) of every routed choice
  // STRATA_METAL_PROMPT_START_LAYERS: at turn start, queue profile-ranked experts of layers
  // 0..n-1 (layer 0 up to top_k of them, later layers up to 32 new reads each).
  std::uint32_t start_layers = 1;
  // With lookahead off, the handshake of layer l queues layer l+1's most popular experts by the
  // profile as Profile reads (docs/architecture.md section 6). STRATA_PROFILE_PREFETCH.
  bool profile_prefetch = true;
  // STRATA_PREFETCH_BACKOFF: a PrefetchGovernor caps the speculative reads each handshake
  // starts when they do not pay; off, the cap is always unlimited.
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
  // Cache-aware routing (STRATA_MOCE*): adjusts the routed selection by residency (moce.h).
  MoceParams moce;

  // EngineError(Config) naming the first field out of range for `layout`; validated() returns
  // the options once they pass.
  void validate(const PackLayout& layout) const;
  const WindowOptions& validated(const PackLayout& layout) const {
    validate(layout);
    return *this;
  }
  PlanRules plan_rules(const PackLayout& layout) const;
  SpeculatorOptions speculation() const;
};

// What a Window's own route needs of its backend (moce), for choosing one (make_backend).
Capability route_capability(const PackLayout& layout, const MoceParams& moce);

}  // namespace strata
