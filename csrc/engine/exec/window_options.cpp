#include "exec/window_options.h"

#include <cmath>
#include <string>

#include "common/errors.h"

namespace strata {

void WindowOptions::validate(const PackLayout& layout) const {
  if (max_rows == 0) throw EngineError(ErrorKind::Config, "max_rows must be positive");
  if (!(device_timeout_s > 0) || !std::isfinite(device_timeout_s))
    throw EngineError(ErrorKind::Config, "device_timeout_s must be positive and finite");
  if (moce.mode == MoceMode::Off) return;
  if (!(moce.strength >= 0) || !std::isfinite(moce.strength))
    throw EngineError(ErrorKind::Config, "moce_strength must be finite and >= 0, got " +
                                             std::to_string(moce.strength));
  if (moce.keep_top > layout.top_k)
    throw EngineError(ErrorKind::Config, "moce_keep_top " + std::to_string(moce.keep_top) +
                                             " exceeds the pack's top_k " +
                                             std::to_string(layout.top_k));
}

PlanRules WindowOptions::plan_rules(const PackLayout& layout) const {
  PlanRules r;
  r.n_layers = layout.n_layers;
  r.n_experts = layout.n_experts;
  r.top_k = layout.top_k;
  r.lookahead = lookahead;
  r.two_layer_decode = two_layer_decode;
  r.two_layer_prompt = two_layer_prompt;
  r.two_layer_max = two_layer_max;
  r.decode_rows = decode_rows;
  r.decode_batch_rows = decode_batch_rows;
  r.split_turn = split_turn;
  r.moce = moce;
  return r;
}

SpeculatorOptions WindowOptions::speculation() const {
  SpeculatorOptions s;
  s.lookahead = lookahead;
  s.two_layer_decode = two_layer_decode;
  s.two_layer_prompt = two_layer_prompt;
  s.two_layer_max = two_layer_max;
  s.start_layers = start_layers;
  s.profile_prefetch = profile_prefetch;
  s.prefetch_backoff = prefetch_backoff;
  s.governor = governor;
  s.moce = moce.mode;
  s.split_turn = split_turn;
  return s;
}

Capability route_capability(const PackLayout& layout, const MoceParams& moce) {
  return Capability{Op::Route, &layout, Arithmetic::Float32, moce.mode};
}

}  // namespace strata
