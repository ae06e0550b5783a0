// What the Metal backend dispatches for each command: kernel names, grids and the scalar
// parameters, for one pack layout. Plain C++ with no Metal types, so the Linux emulator tests
// run exactly the plan the macOS host encodes (tests/metal/shim_harness.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "exec/backend.h"
#include "../kernels/params.h"

namespace strata::metal {

struct Dispatch {
  std::string kernel;
  std::uint32_t groups[3] = {1, 1, 1};   // threadgroups per grid
  std::uint32_t threads[3] = {1, 1, 1};  // threads per threadgroup
  KernelParams params{};
};

// How the arena is cut into buffers no longer than the device allows: views of whole slots
// (slot_bytes is a multiple of the 16 KiB page, so a view boundary never splits a record and no
// overlap is needed). Throws EngineError(Config) past STRATA_MAX_ARENA_VIEWS views.
struct ArenaSplit {
  std::uint32_t slots_per_view = 0;
  std::uint32_t n_views = 0;
};
ArenaSplit split_arena(std::uint64_t slot_bytes, std::uint32_t n_slots,
                       std::uint64_t max_buffer_length);

// The kernel-name suffix of a layout's weight format ("f16", "q4_g64_sbf16", ...). Throws
// EngineError(Config) naming what the Metal kernels do not cover.
std::string format_suffix(const PackLayout& L);

class DispatchPlanner {
 public:
  DispatchPlanner(const PackLayout& L, std::uint64_t slot_bytes, std::uint32_t n_slots,
                  std::uint32_t slots_per_view);

  // Appends the dispatches of a compute command (every Op but Signal and Wait), in order.
  // Throws EngineError(Config) for what this backend does not implement (moce).
  void plan(const Command& c, std::vector<Dispatch>* out) const;

  // Every kernel name plan() can produce for this layout (the host loads them up front).
  std::vector<std::string> kernel_names() const;

 private:
  Dispatch make(const std::string& kernel, const Command& c) const;

  const PackLayout& L_;
  KernelParams base_{};
  std::string fmt_;
  std::string act_;  // the activation's kernel-name suffix: "silu" or "oai"
};

}  // namespace strata::metal
