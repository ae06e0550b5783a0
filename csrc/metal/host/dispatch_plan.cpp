#include "dispatch_plan.h"

#include <algorithm>
#include <cstring>

#include "common/errors.h"

namespace strata::metal {
namespace {

constexpr std::uint32_t kRowsPerGroup = 8;     // kernels/matvec.h: 2 simdgroups x 4 rows
constexpr std::uint32_t kTokensPerGroup = 32;  // kernels/topk.h
constexpr std::uint32_t kLinearThreads = 64;   // plan.metal, combine.metal

std::uint32_t ceil_div(std::uint32_t a, std::uint32_t b) { return (a + b - 1) / b; }

[[noreturn]] void unsupported(const std::string& what) {
  throw EngineError(ErrorKind::Config, "Metal backend: " + what);
}

}  // namespace

ArenaSplit split_arena(std::uint64_t slot_bytes, std::uint32_t n_slots,
                       std::uint64_t max_buffer_length) {
  if (slot_bytes == 0 || slot_bytes > max_buffer_length)
    unsupported("an expert record of " + std::to_string(slot_bytes) +
                " bytes does not fit one Metal buffer (max " + std::to_string(max_buffer_length) +
                ")");
  ArenaSplit s;
  const std::uint64_t per_view = max_buffer_length / slot_bytes;
  s.slots_per_view = std::uint32_t(std::min<std::uint64_t>(per_view, std::max(1u, n_slots)));
  s.n_views = std::max(1u, ceil_div(n_slots, s.slots_per_view));
  if (s.n_views > STRATA_MAX_ARENA_VIEWS)
    unsupported("the arena needs " + std::to_string(s.n_views) + " buffers of at most " +
                std::to_string(max_buffer_length) + " bytes; the kernels bind at most " +
                std::to_string(STRATA_MAX_ARENA_VIEWS));
  return s;
}

std::string format_suffix(const PackLayout& L) {
  switch (L.weight_format) {
    case WeightFormat::F32:
      return "f32";
    case WeightFormat::F16:
      return "f16";
    case WeightFormat::BF16:
      return "bf16";
    case WeightFormat::Q4:
    case WeightFormat::Q8:
      break;
    case WeightFormat::Mxfp4:
      return "mxfp4";
    default:
      unsupported("unknown weight format " + std::to_string(std::uint32_t(L.weight_format)));
  }
  if (L.group_size != 32 && L.group_size != 64 && L.group_size != 128)
    unsupported("group size " + std::to_string(L.group_size) + " (kernels cover 32, 64, 128)");
  static const char* scales[] = {"sf32", "sf16", "sbf16"};
  if (L.scale_format > 2) unsupported("scale format " + std::to_string(L.scale_format));
  return std::string(L.weight_format == WeightFormat::Q4 ? "q4" : "q8") + "_g" +
         std::to_string(L.group_size) + "_" + scales[L.scale_format];
}

DispatchPlanner::DispatchPlanner(const PackLayout& L, std::uint64_t slot_bytes,
                                 std::uint32_t n_slots, std::uint32_t slots_per_view)
    : L_(L), fmt_(format_suffix(L)) {
  if (L.top_k == 0 || L.top_k > STRATA_MAX_TOP_K || L.top_k > L.n_experts)
    unsupported("top_k " + std::to_string(L.top_k) + " (kernels cover 1.." +
                std::to_string(STRATA_MAX_TOP_K) + ")");
  switch (L.activation) {
    case Activation::SwiGLU:
      act_ = "silu";
      break;
    case Activation::SwigluOai:
      act_ = "oai";
      break;
    default:
      unsupported("activation " + std::to_string(std::uint32_t(L.activation)));
  }
  std::uint64_t* offsets[3][4] = {
      {&base_.gate_w, &base_.gate_s, &base_.gate_b, &base_.gate_bias},
      {&base_.up_w, &base_.up_s, &base_.up_b, &base_.up_bias},
      {&base_.down_w, &base_.down_s, &base_.down_b, &base_.down_bias}};
  for (const TensorEntry& t : L.tensors)
    if (t.matrix < 3 && t.role <= kRoleBias) *offsets[t.matrix][t.role] = t.offset;
  base_.bias_format = L.bias_format;
  std::memcpy(&base_.act_alpha_bits, &L.act_alpha, 4);
  std::memcpy(&base_.act_limit_bits, &L.act_limit, 4);
  base_.slot_bytes = slot_bytes;
  base_.slots_per_view = slots_per_view;
  base_.n_slots = n_slots;
  base_.n_experts = L.n_experts;
  base_.top_k = L.top_k;
  base_.hidden = L.hidden;
  base_.inter = L.moe_intermediate;
  base_.routing = L.routing == Routing::SoftmaxTopk ? 0 : 1;
  base_.norm_topk_prob = L.norm_topk_prob ? 1 : 0;
}

Dispatch DispatchPlanner::make(const std::string& kernel, const Command& c) const {
  Dispatch d;
  d.kernel = kernel;
  d.params = base_;
  d.params.layer = c.layer;
  d.params.rows = c.rows;
  d.params.pass = c.pass == Pass::Resident ? 0 : 1;
  d.params.distance = c.distance;
  return d;
}

void DispatchPlanner::plan(const Command& c, std::vector<Dispatch>* out) const {
  const std::uint32_t entries = c.rows * L_.top_k;
  auto matvec = [&](const std::string& kernel, std::uint32_t out_rows, std::uint32_t columns) {
    Dispatch d = make(kernel, c);
    d.groups[0] = ceil_div(out_rows, kRowsPerGroup);
    d.groups[1] = columns;
    d.threads[0] = 32;
    d.threads[1] = 2;
    return d;
  };
  auto per_token = [&](const std::string& kernel) {
    Dispatch d = make(kernel, c);
    d.groups[0] = ceil_div(c.rows, kTokensPerGroup);
    d.threads[0] = kTokensPerGroup;
    return d;
  };
  if (c.rows == 0) return;
  switch (c.op) {
    case Op::Route:
      if (c.moce.mode != MoceMode::Off)
        unsupported("cache-aware routing (moce) is not implemented; use the CPU backend for it");
      out->push_back(matvec("route_logits", L_.n_experts, c.rows));
      out->push_back(per_token("route_select"));
      return;
    case Op::RoutePredict:
      if (c.distance != 1 && c.distance != 2)
        unsupported("route_predict distance " + std::to_string(c.distance));
      out->push_back(matvec("route_logits", L_.n_experts, c.rows));
      out->push_back(per_token("route_predict"));
      return;
    case Op::Plan: {
      Dispatch d = make("plan", c);
      d.groups[0] = ceil_div(entries, kLinearThreads);
      d.threads[0] = kLinearThreads;
      out->push_back(d);
      return;
    }
    case Op::GateUp:
      out->push_back(matvec("gate_up_" + fmt_ + "_" + act_, L_.moe_intermediate, entries));
      return;
    case Op::Down:
      out->push_back(matvec("down_" + fmt_, L_.hidden, entries));
      return;
    case Op::MoeMM: {
      // A wave never holds more experts than there are routed entries.
      const std::uint32_t cols = std::min(L_.n_experts, entries);
      Dispatch g = matvec("moe_gate_up_" + fmt_ + "_" + act_, L_.moe_intermediate, cols);
      Dispatch d = matvec("moe_down_" + fmt_, L_.hidden, cols);
      g.params.wave_groups = d.params.wave_groups = cols;
      out->push_back(g);
      out->push_back(d);
      return;
    }
    case Op::Combine: {
      Dispatch d = make("combine", c);
      d.groups[0] = ceil_div(L_.hidden, kLinearThreads);
      d.groups[1] = c.rows;
      d.threads[0] = kLinearThreads;
      out->push_back(d);
      return;
    }
    case Op::Signal:
    case Op::Wait:
      return;
  }
}

std::vector<std::string> DispatchPlanner::kernel_names() const {
  return {"route_logits", "route_select", "route_predict", "plan", "gate_up_" + fmt_ + "_" + act_,
          "down_" + fmt_, "moe_gate_up_" + fmt_ + "_" + act_, "moe_down_" + fmt_, "combine"};
}

}  // namespace strata::metal
