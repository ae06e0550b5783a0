// Times each kernel of one MoE layer call on a backend, every expert of the layer resident, so
// benchmarks/kernels.py can report GFLOP/s and GB/s per kernel and weight format.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "exec/backend.h"
#include "residency/expert_stream.h"

namespace strata {

struct KernelTiming {
  std::string op;
  double seconds;      // median over repeats
  double flops;        // floating-point operations of one run
  double weight_bytes; // expert (or router) bytes one run reads
};

// Needs an arena that holds every expert of `layer`.
std::vector<KernelTiming> bench_kernels(ExpertStream& stream, Backend& backend,
                                        std::uint32_t layer, std::uint32_t rows,
                                        std::uint32_t repeats, std::uint32_t seed);

}  // namespace strata
