#include "bf16_families.h"

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/env.h"
#include "cuda_check.h"
#include "device_memory.h"
#include "kernels/device_types.h"
#include "kernels/mma_experts.h"
#include "kernels/wgmma_experts.h"
#include "pack/weights.h"

namespace strata::cuda {
namespace {

// The known problem: 4 experts of hidden 256 and inter 128, top-2, 16 tokens (token t routes to
// experts t % 4 and (t + 1) % 4, so each group has 8 tokens: the prompt tilings of both families).
constexpr std::uint32_t kE = 4, kK = 2, kH = 256, kI = 128, kRows = 16;
constexpr std::uint64_t kMatBytes = std::uint64_t(kH) * kI * 2;  // one bf16 matrix
constexpr std::uint64_t kSlotBytes = 3 * kMatBytes;

// Device memory for the check's lifetime.
class Scratch {
 public:
  template <class T>
  T* get(std::size_t bytes) {
    return blocks_.emplace_back(bytes).template as<T>();
  }

 private:
  std::deque<DeviceArray> blocks_;  // a deque: adding one moves none of the others
};

// A fixed pseudo-random float in [-1, 1): the same on every machine.
struct Lcg {
  std::uint32_t s;
  float next() {
    s = s * 1664525u + 1013904223u;
    return float(s >> 8) / float(1u << 23) - 1.0f;
  }
};

std::uint16_t bf16_bits(float v) {  // round to nearest even (no NaN here)
  std::uint32_t u;
  std::memcpy(&u, &v, 4);
  return std::uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The group table of the first `rows` tokens, laid out as DevBuffers reads it from groups_n on:
// [1] count, [kE] slot, [kE] start, [kE] count, then the entries (expert e's record is slot e).
std::vector<std::uint32_t> group_table(std::uint32_t rows) {
  std::vector<std::uint32_t> t(1 + 3 * kE + kRows * kK, 0), entries;
  std::uint32_t n = 0;
  for (std::uint32_t e = 0; e < kE; ++e) {
    const auto first = std::uint32_t(entries.size());
    for (std::uint32_t i = 0; i < rows * kK; ++i)
      if ((i / kK + i % kK) % kE == e) entries.push_back(i);
    if (entries.size() == first) continue;
    t[1 + n] = e, t[1 + kE + n] = first, t[1 + 2 * kE + n] = std::uint32_t(entries.size()) - first;
    ++n;
  }
  t[0] = n;
  std::copy(entries.begin(), entries.end(), t.begin() + 1 + 3 * kE);
  return t;
}

}  // namespace

std::string bf16_families_disagree() {
  try {
    DevLayout L;
    L.n_experts = kE, L.top_k = kK, L.hidden = kH, L.inter = kI, L.format = 2;
    for (int m = 0; m < 3; ++m) {
      L.m[m].weight = std::uint64_t(m) * kMatBytes;
      L.m[m].rows = m == 2 ? kH : kI;
      L.m[m].cols = m == 2 ? kI : kH;
    }
    Lcg rng{12345u};
    std::vector<std::uint16_t> arena(kE * kSlotBytes / 2);
    for (std::uint16_t& w : arena) w = bf16_bits(rng.next() * 0.125f);
    std::vector<float> x(kRows * kH), weights(kRows * kK);
    for (float& v : x) v = rng.next();
    for (std::size_t i = 0; i < weights.size(); ++i) weights[i] = i % 2 ? 0.25f : 0.75f;

    Scratch mem;
    DevBuffers b;
    auto* arena_d = mem.get<unsigned char>(kE * kSlotBytes);
    b.arena = arena_d, b.slot_bytes = kSlotBytes, b.n_slots = kE;
    b.x = mem.get<float>(x.size() * 4);
    b.weights = mem.get<float>(weights.size() * 4);
    b.h = mem.get<float>(std::size_t(kRows) * kK * kI * 4);
    b.y = mem.get<float>(std::size_t(kRows) * kK * kH * 4);
    b.x_pieces = mem.get<std::uint16_t>(mma_x_pieces_bytes(L, kRows));
    b.h_pieces = mem.get<std::uint16_t>(mma_h_pieces_bytes(L, kRows));
    b.x_rest = mem.get<std::uint32_t>((kRows + 2) * 4);
    cuda_check(cudaMemset(b.x_rest, 0, (kRows + 2) * 4), "memset");
    auto* groups = mem.get<std::uint32_t>((1 + 3 * kE + kRows * kK) * 4);
    b.groups_n = groups, b.group_slot = groups + 1, b.group_start = groups + 1 + kE;
    b.group_count = groups + 1 + 2 * kE, b.group_entries = groups + 1 + 3 * kE;
    cuda_check(cudaMemcpy(arena_d, arena.data(), kE * kSlotBytes, cudaMemcpyHostToDevice),
               "arena");
    cuda_check(cudaMemcpy(b.weights, weights.data(), weights.size() * 4, cudaMemcpyHostToDevice),
               "weights");

    cudaStream_t s = nullptr;
    cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    struct StreamGuard {
      cudaStream_t s;
      ~StreamGuard() { cudaStreamDestroy(s); }
    } guard{s};
    // y of the first `rows` tokens by one family (entries rows * kK).
    auto run = [&](bool wgmma, std::uint32_t rows) {
      const std::vector<std::uint32_t> t = group_table(rows);
      cuda_check(cudaMemcpyAsync(groups, t.data(), t.size() * 4, cudaMemcpyHostToDevice, s),
                 "groups");
      cuda_check(cudaMemsetAsync(b.y, 0, std::size_t(kRows) * kK * kH * 4, s), "memset");
      cuda_check(wgmma ? launch_gate_up_wgmma(L, b, rows, s) : launch_gate_up_mma(L, b, rows, s),
                 "gate_up");
      cuda_check(wgmma ? launch_down_wgmma(L, b, rows, s) : launch_down_mma(L, b, rows, s),
                 "down");
      std::vector<std::uint32_t> y(std::size_t(rows) * kK * kH);
      cuda_check(cudaMemcpyAsync(y.data(), b.y, y.size() * 4, cudaMemcpyDeviceToHost, s), "y");
      cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
      return y;
    };
    for (const bool bf16_x : {false, true}) {
      std::vector<float> xs = x;
      if (bf16_x)
        for (float& v : xs) v = bf16_to_float(bf16_bits(v));
      cuda_check(cudaMemcpy(b.x, xs.data(), xs.size() * 4, cudaMemcpyHostToDevice), "x");
      const char* which = bf16_x ? "bf16 values" : "float32";
      const std::vector<std::uint32_t> wave = run(true, kRows);
      if (run(false, kRows) != wave)
        return std::string("a wave of x in ") + which + " differs between mma.sync and wgmma";
      const std::vector<std::uint32_t> alone = run(false, 1);
      if (!std::equal(alone.begin(), alone.end(), wave.begin()))
        return std::string("a token of x in ") + which +
               " differs alone (mma.sync) and in a wave (wgmma)";
    }
    return "";
  } catch (const std::exception& e) {  // cuda_check cleared the runtime's error
    return std::string("the check failed: ") + e.what();
  }
}

Bf16Family bf16_family_asked() {
  switch (env::choice("STRATA_CUDA_BF16", {"auto", "mma", "wgmma"})) {
    case 1: return Bf16Family::Mma;
    case 2:
      if (const std::string why = wgmma_unavailable(); !why.empty())
        throw std::runtime_error("STRATA_CUDA_BF16=wgmma: " + why);
      return Bf16Family::Wgmma;
  }
  return Bf16Family::Auto;
}

Bf16Family bf16_family_settled(Bf16Family asked, std::string* note) {
  if (asked != Bf16Family::Auto) return asked;
  static std::once_flag once;
  static std::string why;  // written once, under `once`
  std::call_once(once, [] {
    why = wgmma_unavailable();
    if (why.empty()) why = bf16_families_disagree();
  });
  if (why.empty()) return Bf16Family::Auto;
  if (note) *note = "bf16 passes on mma.sync alone: " + why;
  return Bf16Family::Mma;
}

std::string bf16_family_description() {
  std::string note;
  switch (bf16_family_settled(bf16_family_asked(), &note)) {
    case Bf16Family::Wgmma: return "wgmma (every bf16 pass)";
    case Bf16Family::Auto:
      return "auto: wgmma from " + std::to_string(kWgmmaFromRows) +
             " rows, mma.sync below (the two families' bits checked equal on this GPU)";
    case Bf16Family::Mma: break;
  }
  return note.empty() ? "mma.sync (every bf16 pass)" : note;
}

}  // namespace strata::cuda
