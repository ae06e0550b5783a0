// What the CUDA kernels see: the pack's geometry and byte layout flattened into a POD passed by
// value to every launch, and the device addresses of every buffer. Plain C++ (no CUDA types), so
// the host backend and the kernels share one definition.
#pragma once

#include <cstdint>

namespace strata::cuda {

constexpr std::uint32_t kAbsentSlot = 0xFFFFFFFFu;  // smap's ABSENT (residency/slot.h)
constexpr std::uint64_t kNoTensor = ~0ull;          // a tensor the record does not have

// One expert matrix inside a record: offsets (from the record's start) of its weight, affine
// scales and biases, and the Linear's own bias; kNoTensor where absent.
struct DevMatrix {
  std::uint64_t weight = kNoTensor, scales = kNoTensor, biases = kNoTensor, bias = kNoTensor;
  std::uint32_t rows = 0, cols = 0;
};

// Which instruction family a layout's bf16 passes take (DevLayout::bf16_wgmma's values).
enum class Bf16Family : std::uint32_t {
  Mma = 0,    // mma.sync (mma_experts.cu) for every pass (any GPU the build runs on)
  Wgmma = 1,  // Hopper's wgmma (wgmma_experts.cu) for every pass (its decode is the slower)
  Auto = 2,   // wgmma for passes of kWgmmaFromRows rows and more, mma.sync below (the default
              // where the two families gave the same bits on a known problem)
};

// PackLayout, as the kernels need it. Codes are PackLayout's enums' values.
struct DevLayout {
  std::uint32_t n_experts = 0, top_k = 0, hidden = 0, inter = 0;
  std::uint32_t routing = 0;  // Routing: 0 SoftmaxTopk, 1 TopkSoftmax
  std::uint32_t norm_topk = 0;
  std::uint32_t format = 0;  // WeightFormat: 0 f32, 1 f16, 2 bf16, 3 q4, 4 q8, 5 mxfp4
  std::uint32_t group_size = 0, scale_format = 0;  // scale_format: 0 f32, 1 f16, 2 bf16, 3 e8m0
  std::uint32_t bias_format = 0;                   // 0 none, else 1 + scale-format code
  std::uint32_t activation = 0;                    // 0 SwiGLU, 1 SwigluOai
  float act_alpha = 0, act_limit = 0;
  DevMatrix m[3];  // gate, up, down
  // The bf16 kernels' family, a Bf16Family (above; host/bf16_families.h settles it). The choice
  // is the pass's rows' alone, so a layer's bits do not depend on the arena or the split (I11);
  // the same arithmetic either way.
  std::uint32_t bf16_wgmma = 0;
  // Tests only (STRATA_CUDA_TEST_PLANT): a deliberate error in one kernel, which the parity tests
  // must catch. 0 in every real run, and read only by kernels built with STRATA_CUDA_PLANT.
  std::uint32_t plant = 0;
};

// Planted errors (DevLayout::plant bits). The kernels test them only in a build for the CUDA
// tests (CMake's STRATA_CUDA_TEST_PLANT=ON defines STRATA_CUDA_PLANT=1; tests/cuda/device_run.sh
// builds so): release kernels carry no planted branch.
#ifndef STRATA_CUDA_PLANT
#define STRATA_CUDA_PLANT 0
#endif
constexpr std::uint32_t kPlantGateUp = 1;  // h gets 2^-10 added to one row
constexpr std::uint32_t kPlantRoute = 2;   // the second expert's weight scaled by 1 + 2^-10

// The device error word (pinned host memory mapped into the GPU): a kernel that finds a
// missing-pass expert without a published slot writes it once, computes nothing, and the host
// reads and clears it after the stream synchronizes.
struct DevError {
  std::uint32_t flag, layer, expert, what;  // what: 1 resident, 2 missing, 3 wave
};

// Device addresses. arena and smap are the host's pages mapped into the GPU (cudaHostRegister);
// everything else is device memory the backend owns.
struct DevBuffers {
  const unsigned char* arena = nullptr;
  std::uint64_t slot_bytes = 0;
  std::uint32_t n_slots = 0;
  const std::uint32_t* smap = nullptr;
  const float* routers = nullptr;
  float* x = nullptr;
  std::int32_t* ids = nullptr;
  float* weights = nullptr;
  std::int32_t* pred_ids[2] = {};
  float* logits = nullptr;            // [tasks][rows][n_experts] the route kernel's scratch
  std::uint32_t* route_done = nullptr;  // [tasks][rows] its blocks-done counters, kept zero
  std::uint32_t* plan = nullptr;
  float* h = nullptr;
  // The bf16 pieces (hi, mid, lo: mma.cuh's split3) of x's rows and of h's, [rows][3][hidden] and
  // [rows * top_k][3][inter], which the tensor-core prompt kernels stage instead of splitting
  // float32 rows in every block (mma_experts.h sizes them). Null: every block splits its own.
  std::uint16_t* x_pieces = nullptr;
  std::uint16_t* h_pieces = nullptr;
  // [2 + rows] Written by the split into x_pieces (pieces.cuh), read by gate_up's prompt kernels:
  // [0] whether some row of the pass's x has a nonzero mid or lo piece (zero: x's values are all
  // bf16, as a bf16 model's are, and gate_up multiplies by the hi pieces alone, with the same
  // bits); [1] the split's blocks-done counter, kept zero; [2 + r] row r's own answer. Null:
  // three pieces always.
  std::uint32_t* x_rest = nullptr;
  float* y = nullptr;
  float* out = nullptr;
  const std::int32_t* wave = nullptr;
  const std::uint32_t* wave_n = nullptr;
  // A pass's entries grouped by expert (written by the group kernel, read by the matmuls).
  std::uint32_t* groups_n = nullptr;       // [1]
  std::uint32_t* group_slot = nullptr;     // [n_experts]
  std::uint32_t* group_start = nullptr;    // [n_experts]
  std::uint32_t* group_count = nullptr;    // [n_experts]
  std::uint32_t* group_entries = nullptr;  // [max_rows * top_k]
  std::uint32_t* expert_count = nullptr;   // [n_experts] grouping scratch
  std::uint32_t* expert_cursor = nullptr;  // [n_experts]
  std::uint32_t* expert_first = nullptr;   // [n_experts]
  std::uint32_t* in_wave = nullptr;        // [n_experts]
  // The host's copy of the group table, laid out as the device one from groups_n on, where the
  // host grouped the pass (device arena): the decode kernels then take the groups as kernel
  // arguments instead of reading them (a dependent read before the weights). Host memory,
  // read at launch; null: the kernels read the device table.
  const std::uint32_t* host_groups = nullptr;
  DevError* error = nullptr;
};

// Which entries an expert pass computes.
enum class Select : std::uint32_t { Resident = 1, Missing = 2, Wave = 3 };

}  // namespace strata::cuda
