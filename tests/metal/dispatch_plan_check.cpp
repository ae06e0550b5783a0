// The Metal host's dispatch plan (csrc/metal/host/dispatch_plan.h) on its edges: what it
// refuses, and by which message; how the arena is cut into views. Exit 0 only when all pass.
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "../../csrc/metal/host/dispatch_plan.h"
#include "common/errors.h"

using namespace strata;

namespace {

int failures = 0;
void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

// True when fn throws EngineError(Config) whose message contains `needle`.
bool refuses(const std::function<void()>& fn, const std::string& needle) {
  try {
    fn();
  } catch (const EngineError& e) {
    return e.kind() == ErrorKind::Config && std::string(e.what()).find(needle) != std::string::npos;
  }
  return false;
}

PackLayout layout() {
  PackLayout L;
  L.n_layers = 4;
  L.n_experts = 16;
  L.top_k = 4;
  L.hidden = 256;
  L.moe_intermediate = 100;
  L.weight_format = WeightFormat::Q8;
  L.group_size = 32;
  L.scale_format = 1;
  return L;
}

}  // namespace

int main() {
  const std::uint64_t slot = 16384 * 4;
  auto s = metal::split_arena(slot, 100, 30 * slot);
  check(s.slots_per_view == 30 && s.n_views == 4, "100 slots, 30 per buffer: 4 views of 30");
  s = metal::split_arena(slot, 8, 1000 * slot);
  check(s.slots_per_view == 8 && s.n_views == 1, "a small arena is one view");
  check(refuses([&] { metal::split_arena(slot, 100, 10 * slot); }, "at most 8"),
        "more than 8 views is refused by name");
  check(refuses([&] { metal::split_arena(slot, 1, slot - 1); }, "does not fit one Metal buffer"),
        "a record larger than a buffer is refused");

  PackLayout L = layout();
  check(metal::format_suffix(L) == "q8_g32_sf16", "format suffix q8_g32_sf16");
  PackLayout bad = L;
  bad.group_size = 256;
  check(refuses([&] { metal::format_suffix(bad); }, "group size 256"), "group 256 is refused");
  bad = L;
  bad.top_k = 33;
  bad.n_experts = 64;
  check(refuses([&] { metal::DispatchPlanner(bad, slot, 10, 10); }, "top_k 33"),
        "top_k past 32 is refused");
  {  // gpt-oss: its own activation kernels, alpha/limit and the Linear biases handed over
    PackLayout oai = L;
    oai.activation = Activation::SwigluOai;
    oai.act_alpha = 1.702f;
    oai.act_limit = 7.0f;
    oai.bias_format = 3;
    oai.tensors = {TensorEntry{0, kRoleBias, 512, 200, 1, 100},
                   TensorEntry{2, kRoleBias, 1024, 512, 1, 256}};
    metal::DispatchPlanner planner(oai, slot, 10, 10);
    std::vector<metal::Dispatch> ds;
    Command c;
    c.op = Op::GateUp;
    c.rows = 1;
    planner.plan(c, &ds);
    float alpha = 0, limit = 0;
    std::memcpy(&alpha, &ds[0].params.act_alpha_bits, 4);
    std::memcpy(&limit, &ds[0].params.act_limit_bits, 4);
    check(ds.size() == 1 && ds[0].kernel == "gate_up_q8_g32_sf16_oai" && alpha == 1.702f &&
              limit == 7.0f,
          "gpt-oss's clamped SwiGLU runs its own kernels with the pack's alpha and limit");
    check(ds[0].params.bias_format == 3 && ds[0].params.gate_bias == 512 &&
              ds[0].params.down_bias == 1024,
          "expert Linear biases reach the kernels: format and offsets");
  }

  metal::DispatchPlanner planner(L, slot, 64, 16);
  std::vector<metal::Dispatch> ds;
  Command c;
  c.op = Op::Route;
  c.rows = 3;
  c.layer = 2;
  c.moce.mode = MoceMode::Scale;
  check(refuses([&] { planner.plan(c, &ds); }, "moce"), "Route with moce on is refused by name");
  c.moce.mode = MoceMode::Off;
  ds.clear();
  planner.plan(c, &ds);
  check(ds.size() == 2 && ds[0].kernel == "route_logits" && ds[1].kernel == "route_select" &&
            ds[0].groups[0] == 2 && ds[0].groups[1] == 3 && ds[0].params.layer == 2,
        "Route: logits grid (ceil(16/8), rows), then select");
  c.op = Op::GateUp;
  c.pass = Pass::Missing;
  ds.clear();
  planner.plan(c, &ds);
  check(ds.size() == 1 && ds[0].kernel == "gate_up_q8_g32_sf16_silu" && ds[0].groups[0] == 13 &&
            ds[0].groups[1] == 12 && ds[0].params.pass == 1 && ds[0].threads[0] == 32 &&
            ds[0].threads[1] == 2,
        "GateUp: ceil(100/8) row blocks x rows*k entries, threadgroup (32, 2), missing pass");
  c.op = Op::MoeMM;
  c.rows = 64;
  ds.clear();
  planner.plan(c, &ds);
  check(ds.size() == 2 && ds[0].groups[1] == 16 && ds[1].kernel == "moe_down_q8_g32_sf16" &&
            ds[1].groups[0] == 32,
        "MoeMM: columns capped at n_experts; gate_up then down");
  c.op = Op::Signal;
  ds.clear();
  planner.plan(c, &ds);
  check(ds.empty(), "Signal and Wait dispatch nothing");
  return failures == 0 ? 0 : 1;
}
