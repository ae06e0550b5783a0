#include "cpu/cpu_kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "cpu/mlx_kernels.h"
#include "residency/slot.h"
#include "residency/smap.h"
#include "pack/weights.h"

namespace strata::cpu {
namespace {

inline float silu(float z) { return z / (1.0f + std::exp(-z)); }

// The expert activation of one element; every path (decode passes, prompt waves, routed calls)
// calls this one function, so they stay bitwise identical (I11).
inline float activate(const ExpertView& ev, float g, float u) {
  if (ev.activation == Activation::SwiGLU) return silu(g) * u;
  // gpt-oss: the gate clipped from above only, the linear part both ways and shifted by one.
  const float lim = ev.act_limit;
  const float gc = std::min(g, lim);
  const float uc = std::min(std::max(u, -lim), lim);
  return (uc + 1.0f) * (gc / (1.0f + std::exp(-ev.act_alpha * gc)));
}

// One expert's share of a pass: the (t * k + j) entries routed to it and its published slot.
struct Group {
  std::uint32_t expert;
  std::uint32_t slot;
  std::vector<std::uint32_t> entries;
};

// Groups the routed entries of `rows` tokens by expert, keeping those the predicate accepts.
// Slot resolution is the caller's: the plan's snapshot (resident) or smap now (missing).
template <class Accept>
std::vector<Group> group_entries(const DeviceBuffers& b, std::uint32_t rows, Accept accept) {
  const std::uint32_t k = b.layout->top_k;
  std::vector<std::int32_t> index(b.layout->n_experts, -1);
  std::vector<Group> groups;
  for (std::uint32_t i = 0; i < rows * k; ++i) {
    const std::uint32_t e = std::uint32_t(b.ids[i]);
    if (!accept(i, e)) continue;
    if (index[e] < 0) {
      index[e] = std::int32_t(groups.size());
      groups.push_back(Group{e, kAbsent, {}});
    }
    groups[std::size_t(index[e])].entries.push_back(i);
  }
  return groups;
}

// h[i] = silu(gate x_t) * (up x_t) for every entry of the group, rows [r0, r1) of gate/up.
void gate_up_rows(const DeviceBuffers& b, const ExpertView& ev, const Group& g, std::uint32_t r0,
                  std::uint32_t r1, float* gbuf, float* ubuf) {
  const std::uint32_t H = b.layout->hidden, I = b.layout->moe_intermediate, k = b.layout->top_k;
  for (std::uint32_t r = r0; r < r1; ++r) {
    ev.gate.row(r, gbuf);
    ev.up.row(r, ubuf);
    const float gb = ev.gate.bias_at(r), ub = ev.up.bias_at(r);
    for (std::uint32_t i : g.entries) {
      const float* x = b.x + std::size_t(i / k) * H;
      b.h[std::size_t(i) * I + r] = activate(ev, dot(gbuf, x, H) + gb, dot(ubuf, x, H) + ub);
    }
  }
}

// y[i] = w_i * (down h_i), rows [r0, r1) of down.
void down_rows(const DeviceBuffers& b, const ExpertView& ev, const Group& g, std::uint32_t r0,
               std::uint32_t r1, float* dbuf) {
  const std::uint32_t H = b.layout->hidden, I = b.layout->moe_intermediate;
  for (std::uint32_t r = r0; r < r1; ++r) {
    ev.down.row(r, dbuf);
    const float db = ev.down.bias_at(r);
    for (std::uint32_t i : g.entries)
      b.y[std::size_t(i) * H + r] = b.weights[i] * (dot(dbuf, b.h + std::size_t(i) * I, I) + db);
  }
}

enum class Stage { GateUp, Down, Both };

// Below this many multiply-adds a parallel-for runs on the calling thread: waking the workers
// and waiting for them costs tens of microseconds (a futex round trip each way; more on a
// virtual machine), which is more than the work. Which thread computes an element never
// changes its bits (each element has one fixed sequence of operations), so this is speed only.
constexpr std::uint64_t kInlineMacs = std::uint64_t(1) << 18;

void parallel_for(const ParallelFor& pf, std::uint32_t n, std::uint64_t macs,
                  const std::function<void(std::uint32_t, std::uint32_t)>& fn) {
  if (macs < kInlineMacs) {
    if (n) fn(0, n);
    return;
  }
  pf(n, fn);
}

// One matrix stage over every group at once, parallel over (group, matrix row) pairs: one
// fork-join per stage, not one per expert (a decode batch's union is tens of experts). `rows`
// is the stage's output rows per expert; fn(group, r0, r1) computes rows [r0, r1) of a group.
template <class Fn>
void over_groups(const ParallelFor& pf, const std::vector<Group>& groups, std::uint32_t rows,
                 std::uint64_t macs_per_row_entry, Fn fn) {
  std::uint64_t macs = 0;
  for (const Group& g : groups) macs += (g.entries.size() + 1) * macs_per_row_entry * rows;
  const std::uint32_t n = std::uint32_t(groups.size()) * rows;
  parallel_for(pf, n, macs, [&](std::uint32_t i0, std::uint32_t i1) {
    while (i0 < i1) {  // the chunk, cut where it crosses from one group into the next
      const std::uint32_t g = i0 / rows, end = std::min(i1, (g + 1) * rows);
      fn(g, i0 - g * rows, end - g * rows);
      i0 = end;
    }
  });
}

// Runs a stage over groups (each output element has one writer). Both (prompt waves): every
// group's gate_up, then every group's down, which reads only its own entries' complete h.
void run_groups(const DeviceBuffers& b, std::uint32_t layer, const std::vector<Group>& groups,
                Stage stage, const ParallelFor& pf, Rounding rounding) {
  const std::uint32_t H = b.layout->hidden, I = b.layout->moe_intermediate;
  const bool as_mlx = rounding.arithmetic != Arithmetic::Float32;
  std::vector<ExpertView> views;
  views.reserve(groups.size());
  for (const Group& g : groups)
    views.push_back(
        expert_view(*b.layout, layer, b.arena + std::uint64_t(g.slot) * b.slot_bytes));
  if (stage != Stage::Down)
    over_groups(pf, groups, I, 2 * std::uint64_t(H),
                [&](std::uint32_t g, std::uint32_t r0, std::uint32_t r1) {
                  if (as_mlx) return mlx::gate_up_rows(b, views[g], groups[g].entries, r0, r1,
                                                       rounding);
                  std::vector<float> gbuf(H), ubuf(H);
                  gate_up_rows(b, views[g], groups[g], r0, r1, gbuf.data(), ubuf.data());
                });
  if (stage != Stage::GateUp)
    over_groups(pf, groups, H, I, [&](std::uint32_t g, std::uint32_t r0, std::uint32_t r1) {
      if (as_mlx) return mlx::down_rows(b, views[g], groups[g].entries, r0, r1, rounding);
      std::vector<float> dbuf(I);
      down_rows(b, views[g], groups[g], r0, r1, dbuf.data());
    });
}

bool resolve_pass(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows, Pass pass,
                  std::vector<Group>* out) {
  const std::uint32_t E = b.layout->n_experts;
  auto groups = group_entries(b, rows, [&](std::uint32_t i, std::uint32_t) {
    return (b.plan[i] != kAbsent) == (pass == Pass::Resident);
  });
  for (Group& g : groups) {
    // Resident: the slot the plan saw (I8 keeps it valid). Missing: published by now (release 2).
    g.slot = pass == Pass::Resident ? b.plan[g.entries.front()]
                                    : smap_load(b.smap, layer * E + g.expert);
    if (g.slot == kAbsent || g.slot >= b.n_slots) return false;
  }
  *out = std::move(groups);
  return true;
}

}  // namespace

float dot(const float* a, const float* b, std::uint32_t n) {
  // Two 8-float vector accumulators (GCC/Clang vector extensions: AVX on x86-64, NEON pairs on
  // arm64) hide the add latency; the lane fold and the scalar tail run in a fixed order, so the
  // result depends only on the inputs.
  typedef float v8 __attribute__((vector_size(32)));
  v8 acc0 = {}, acc1 = {};
  std::size_t i = 0;
  const std::size_t len = n;
  for (; i + 16 <= len; i += 16) {
    v8 a0, a1, b0, b1;
    std::memcpy(&a0, a + i, 32);
    std::memcpy(&a1, a + i + 8, 32);
    std::memcpy(&b0, b + i, 32);
    std::memcpy(&b1, b + i + 8, 32);
    acc0 += a0 * b0;
    acc1 += a1 * b1;
  }
  v8 acc = acc0 + acc1;
  float tail = 0;
  for (; i < len; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])) + tail;
}

void route(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows, std::int32_t* ids,
           float* weights, const ParallelFor& pf, const MoceParams& moce) {
  const PackLayout& L = *b.layout;
  const std::uint32_t E = L.n_experts, H = L.hidden, k = L.top_k;
  const float* router = b.routers + std::size_t(layer) * E * H;
  const bool adjust = moce.mode != MoceMode::Off && weights;
  if (adjust)  // one snapshot for the whole chunk: every token sees the same residency
    for (std::uint32_t e = 0; e < E; ++e)
      b.route_resident[e] = smap_load(b.smap, layer * E + e) != kAbsent;
  parallel_for(pf, rows, std::uint64_t(rows) * E * H, [&](std::uint32_t t0, std::uint32_t t1) {
    std::vector<std::uint32_t> order(E);
    std::vector<float> prob(adjust ? E : 0);
    std::vector<std::uint32_t> selected(adjust ? k : 0), scratch(adjust ? 2 * E : 0);
    auto by_logit = [&](const float* logit) {
      return [logit](std::uint32_t a, std::uint32_t c) {
        return logit[a] > logit[c] || (logit[a] == logit[c] && a < c);
      };
    };
    for (std::uint32_t t = t0; t < t1; ++t) {
      float* logit = b.logits + std::size_t(t) * E;
      const float* x = b.x + std::size_t(t) * H;
      for (std::uint32_t e = 0; e < E; ++e) logit[e] = dot(router + std::size_t(e) * H, x, H);
      // Top-k by logit (softmax is monotonic); ties go to the lower expert index.
      for (std::uint32_t e = 0; e < E; ++e) order[e] = e;
      float top;  // the largest logit: the softmax shift
      if (adjust) {
        // moce needs the whole ranking and the true probabilities (softmax over every expert,
        // whatever the routing rule: it is what the router says about each expert).
        std::sort(order.begin(), order.end(), by_logit(logit));
        top = logit[order[0]];
        float total = 0;
        for (std::uint32_t e = 0; e < E; ++e) total += std::exp(logit[e] - top);
        for (std::uint32_t e = 0; e < E; ++e) prob[e] = std::exp(logit[e] - top) / total;
        MoceDelta d = moce_select(moce, order.data(), prob.data(), b.route_resident, E, k,
                                  selected.data(), scratch.data());
        std::copy(selected.begin(), selected.end(), order.begin());
        b.moce_moved[t] = d.moved;
        b.moce_changed[t] = d.changed;
      } else {
        std::partial_sort(order.begin(), order.begin() + k, order.end(), by_logit(logit));
        top = logit[order[0]];
      }
      for (std::uint32_t j = 0; j < k; ++j) ids[std::size_t(t) * k + j] = std::int32_t(order[j]);
      if (!weights) continue;
      // Mixture weights: the model's own rule applied to the selected experts' true logits. The
      // moce scale factor only steers the choice; it is not evidence about the token, so it does
      // not enter the weights. A token whose selection moce left alone therefore gets bitwise
      // the weights of exact routing, and the block is exactly the model evaluated with that
      // selection (tests/test_moce.py checks both).
      float* w = weights + std::size_t(t) * k;
      if (L.routing == Routing::SoftmaxTopk) {
        // Softmax over every expert, then the chosen probabilities (renormalised if asked).
        float total = 0;
        for (std::uint32_t e = 0; e < E; ++e) total += std::exp(logit[e] - top);
        float chosen = 0;
        for (std::uint32_t j = 0; j < k; ++j) {
          w[j] = std::exp(logit[order[j]] - top) / total;
          chosen += w[j];
        }
        if (L.norm_topk_prob)
          for (std::uint32_t j = 0; j < k; ++j) w[j] /= chosen;
      } else {
        // Mixtral: softmax over the k chosen logits only, shifted by the largest of them (the
        // selection is in true-rank order; without moce it is the largest logit, `top`).
        const float top_chosen = logit[order[0]];
        float total = 0;
        for (std::uint32_t j = 0; j < k; ++j) total += std::exp(logit[order[j]] - top_chosen);
        for (std::uint32_t j = 0; j < k; ++j) w[j] = std::exp(logit[order[j]] - top_chosen) / total;
      }
    }
  });
}

void plan(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows) {
  const std::uint32_t E = b.layout->n_experts, k = b.layout->top_k;
  for (std::uint32_t i = 0; i < rows * k; ++i)
    b.plan[i] = smap_load(b.smap, layer * E + std::uint32_t(b.ids[i]));
}

bool gate_up(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows, Pass pass,
             const ParallelFor& pf, Rounding rounding) {
  std::vector<Group> groups;
  if (!resolve_pass(b, layer, rows, pass, &groups)) return false;
  run_groups(b, layer, groups, Stage::GateUp, pf, rounding);
  return true;
}

bool down(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows, Pass pass,
          const ParallelFor& pf, Rounding rounding) {
  std::vector<Group> groups;
  if (!resolve_pass(b, layer, rows, pass, &groups)) return false;
  run_groups(b, layer, groups, Stage::Down, pf, rounding);
  return true;
}

bool moe_mm(const DeviceBuffers& b, std::uint32_t layer, std::uint32_t rows, const ParallelFor& pf,
            Rounding rounding) {
  const std::uint32_t E = b.layout->n_experts;
  const std::uint32_t n_wave = *b.wave_n;
  std::vector<char> in_wave(E, 0);
  for (std::uint32_t w = 0; w < n_wave; ++w) in_wave[std::uint32_t(b.wave[w])] = 1;
  auto groups = group_entries(b, rows, [&](std::uint32_t, std::uint32_t e) { return in_wave[e]; });
  for (Group& g : groups) {
    g.slot = smap_load(b.smap, layer * E + g.expert);
    if (g.slot == kAbsent || g.slot >= b.n_slots) return false;
  }
  run_groups(b, layer, groups, Stage::Both, pf, rounding);
  return true;
}

void combine(const DeviceBuffers& b, std::uint32_t rows, const ParallelFor& pf) {
  const std::uint32_t H = b.layout->hidden, k = b.layout->top_k;
  parallel_for(pf, rows, std::uint64_t(rows) * k * H, [&](std::uint32_t t0, std::uint32_t t1) {
    for (std::uint32_t t = t0; t < t1; ++t) {
      float* o = b.out + std::size_t(t) * H;
      const float* y0 = b.y + std::size_t(t) * k * H;
      std::copy(y0, y0 + H, o);
      for (std::uint32_t j = 1; j < k; ++j) {
        const float* yj = y0 + std::size_t(j) * H;
        for (std::uint32_t c = 0; c < H; ++c) o[c] += yj[c];
      }
    }
  });
}

}  // namespace strata::cpu
