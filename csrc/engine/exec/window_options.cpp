#include "exec/window_options.h"

#include <cmath>
#include <sstream>
#include <string>

#include "common/errors.h"

namespace strata {

namespace {

[[noreturn]] void refuse(const std::string& what) { throw EngineError(ErrorKind::Config, what); }

// The number as Python prints it (600.0, nan, inf), for the messages.
std::string number(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  std::ostringstream s;
  s << v;
  return s.str();
}

void require_positive_seconds(double v, const char* what) {
  if (!(v > 0) || !std::isfinite(v))
    refuse(std::string(what) + " must be positive and finite, got " + number(v));
}

}  // namespace

void validate(const StreamOptions& o) {
  if (o.arena_bytes == 0) refuse("arena_bytes must be positive");
  if (o.io_threads > 256)
    refuse("io_threads must be 0..256 (0 = manual IO for tests), got " +
           std::to_string(o.io_threads));
  if (o.part_bytes == 0 || o.part_bytes % kPage != 0)
    refuse("part_bytes must be a positive multiple of " + std::to_string(kPage) + ", got " +
           std::to_string(o.part_bytes));
  if (o.io_spin_us > 100000)
    refuse("io_spin_us must be 0..100000 (microseconds), got " + std::to_string(o.io_spin_us));
  require_positive_seconds(o.io_timeout_s, "io_timeout_s");
}

void WindowOptions::validate() const {
  if (max_rows == 0) refuse("max_rows must be positive");
  require_positive_seconds(device_timeout_s, "device_timeout_s");
  if (two_layer_max > kTwoLayerMaxLimit)
    refuse("two_layer_max must be 0.." + std::to_string(kTwoLayerMaxLimit) + ", got " +
           std::to_string(two_layer_max));
  if (!(moce.strength >= 0) || !std::isfinite(moce.strength))
    refuse("moce_strength must be finite and >= 0, got " + number(moce.strength));
}

void WindowOptions::validate(const PackLayout& layout) const {
  validate();
  if (moce.mode == MoceMode::Off) return;
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
