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
  // Expert passes only (else 0): the median bytes/s of a plain read from memory, made right
  // before each run, of what the pass reads (its matrices' weights and scales, for each chosen
  // expert), and the median of each run's weight bytes/s over that read's.
  double paired_read_bytes_per_s = 0;
  double paired_ratio = 0;
};

// Needs an arena that holds every expert of `layer`. flush_bytes > 0: before each timed run
// (untimed) a buffer of that many bytes is read, so the run finds its weights in memory, not in
// a cache, as a streamed layer does. `threads` (0: every core): the backend's, which the paired
// read of each expert pass uses too.
std::vector<KernelTiming> bench_kernels(ExpertStream& stream, Backend& backend,
                                        std::uint32_t layer, std::uint32_t rows,
                                        std::uint32_t repeats, std::uint32_t seed,
                                        std::uint64_t flush_bytes = 0, unsigned threads = 0);

// The host's streaming read bandwidth in bytes per second: `threads` threads (0: every core)
// each summing its contiguous share of one buffer of `bytes` (written first, so every page is
// resident), median of `repeats`. The ceiling a kernel reading its weights once can reach.
double read_bandwidth(std::uint64_t bytes, unsigned threads, std::uint32_t repeats);

}  // namespace strata
