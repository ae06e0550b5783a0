// The Linux host check's program (STRATA_METAL_HOST_CHECK): the Metal host compiled and linked
// against the real metal-cpp headers; with no device it must refuse cleanly, by a named engine
// error, and the portable dispatch plan must cover a real layout. Exit 0 only for that.
#include <cstdio>
#include <string>

#include "common/errors.h"
#include "dispatch_plan.h"
#include "metal_backend.h"

int main() {
  // The plan for a Qwen3-30B-A3B-shaped layout (q4, group 64, bf16 scales).
  strata::PackLayout L;
  L.n_layers = 48;
  L.n_experts = 128;
  L.top_k = 8;
  L.hidden = 2048;
  L.moe_intermediate = 768;
  L.weight_format = strata::WeightFormat::Q4;
  L.group_size = 64;
  L.scale_format = 2;
  const std::uint64_t slot_bytes = strata::kPage * 128;
  const auto split = strata::metal::split_arena(slot_bytes, 1536, std::uint64_t(1) << 34);
  strata::metal::DispatchPlanner planner(L, slot_bytes, 1536, split.slots_per_view);
  std::vector<strata::metal::Dispatch> ds;
  strata::Command c;
  c.op = strata::Op::GateUp;
  c.rows = 1;
  planner.plan(c, &ds);
  std::printf("plan: %s grid %ux%u, %u arena view(s)\n", ds.at(0).kernel.c_str(),
              ds.at(0).groups[0], ds.at(0).groups[1], split.n_views);
  try {
    auto backend = strata::make_metal_backend();
    std::printf("unexpected: a Metal device on this machine (%s)\n", backend->name().c_str());
    return 1;
  } catch (const strata::EngineError& e) {
    std::printf("make_metal_backend: %s\n", e.what());
    return std::string(e.what()).find("no Metal device") != std::string::npos ? 0 : 1;
  }
}
