// The kernel parity harness (the ggml test-backend-ops idea): one pack, one input, every
// backend operation run twice on identical buffers - by the CPU backend's kernels and by the
// .metal kernels under the Linux emulator, dispatched exactly as the Metal host plans them
// (csrc/metal/host/dispatch_plan.h). Each scenario's arrays are written as raw little-endian
// files `<scenario>.<cpu|metal>.<name>.bin` for tests/metal/test_kernels_shim.py, which also
// checks them against the numpy oracle.
//
//   shim_harness PACK OUT_DIR ROWS LAYER SEED     run every scenario
//   shim_harness --list                           print the registered kernel names
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "../../csrc/metal/host/dispatch_plan.h"
#include "shim/msl_runtime.h"
#include "cpu/cpu_kernels.h"
#include "pack/pack_file.h"
#include "residency/slot.h"

namespace {

using strata::Command;
using strata::DeviceBuffers;
using strata::Op;
using strata::Pass;

struct Scratch {
  std::vector<float> x, weights, logits, h, y, out;
  std::vector<std::int32_t> ids, pred1, pred2, wave;
  std::vector<std::uint32_t> plan, wave_n;
  std::vector<std::uint32_t> status;  // the Metal status words (atomic_uint on the device)
};

void alloc(Scratch& s, const strata::PackLayout& L, std::uint32_t rows) {
  const std::size_t T = rows, k = L.top_k, E = L.n_experts, H = L.hidden, I = L.moe_intermediate;
  s.x.assign(T * H, 0.f);
  s.weights.assign(T * k, 0.f);
  s.logits.assign(T * E, 0.f);
  s.h.assign(T * k * I, 0.f);
  s.y.assign(T * k * H, 0.f);
  s.out.assign(T * H, 0.f);
  s.ids.assign(T * k, 0);
  s.pred1.assign(T * k, 0);
  s.pred2.assign(T * k, 0);
  s.wave.assign(E, 0);
  s.plan.assign(T * k, 0);
  s.wave_n.assign(1, 0);
  s.status.assign(STRATA_STATUS_WORDS, 0);
}

DeviceBuffers cpu_view(Scratch& s, const strata::PackLayout& L, const unsigned char* arena,
                       std::uint64_t stride, std::uint32_t n_slots, const std::uint32_t* smap,
                       const float* routers, std::uint32_t rows) {
  DeviceBuffers b;
  b.layout = &L;
  b.arena = arena;
  b.slot_bytes = stride;
  b.n_slots = n_slots;
  b.smap = smap;
  b.routers = routers;
  b.max_rows = rows;
  b.x = s.x.data();
  b.ids = s.ids.data();
  b.weights = s.weights.data();
  b.pred_ids[0] = s.pred1.data();
  b.pred_ids[1] = s.pred2.data();
  b.logits = s.logits.data();
  b.plan = s.plan.data();
  b.h = s.h.data();
  b.y = s.y.data();
  b.out = s.out.data();
  b.wave = s.wave.data();
  b.wave_n = s.wave_n.data();
  return b;
}

// The Metal side: planner + emulator over the same kind of buffers.
struct MetalSide {
  strata::metal::DispatchPlanner planner;
  strata_shim::Bindings bind;

  void run(const Command& c) {
    std::vector<strata::metal::Dispatch> ds;
    planner.plan(c, &ds);
    for (const auto& d : ds) {
      strata_shim::KernelFn fn = strata_shim::find_kernel(d.kernel);
      if (!fn) {
        std::fprintf(stderr, "harness: no kernel named %s\n", d.kernel.c_str());
        std::exit(3);
      }
      strata_shim::dispatch(fn, d.params, bind, d.groups, d.threads);
    }
  }
};

strata_shim::Bindings metal_bindings(Scratch& s, const std::uint32_t* smap, const float* routers,
                                     const unsigned char* arena, std::uint64_t stride,
                                     const strata::metal::ArenaSplit& split) {
  strata_shim::Bindings b;
  b.buffer[STRATA_BUF_SMAP] = const_cast<std::uint32_t*>(smap);
  b.buffer[STRATA_BUF_ROUTERS] = const_cast<float*>(routers);
  b.buffer[STRATA_BUF_X] = s.x.data();
  b.buffer[STRATA_BUF_IDS] = s.ids.data();
  b.buffer[STRATA_BUF_WEIGHTS] = s.weights.data();
  b.buffer[STRATA_BUF_PRED1] = s.pred1.data();
  b.buffer[STRATA_BUF_PRED2] = s.pred2.data();
  b.buffer[STRATA_BUF_LOGITS] = s.logits.data();
  b.buffer[STRATA_BUF_PLAN] = s.plan.data();
  b.buffer[STRATA_BUF_H] = s.h.data();
  b.buffer[STRATA_BUF_Y] = s.y.data();
  b.buffer[STRATA_BUF_OUT] = s.out.data();
  b.buffer[STRATA_BUF_WAVE] = s.wave.data();
  b.buffer[STRATA_BUF_WAVE_N] = s.wave_n.data();
  static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));
  b.buffer[STRATA_BUF_STATUS] = s.status.data();
  // Views as the host makes them: view v starts at slot v * slots_per_view; unused indices
  // repeat view 0 (the Metal host binds every index).
  for (std::uint32_t v = 0; v < STRATA_MAX_ARENA_VIEWS; ++v) {
    const std::uint32_t first = v < split.n_views ? v * split.slots_per_view : 0;
    b.buffer[STRATA_BUF_ARENA0 + v] = const_cast<unsigned char*>(arena) + first * stride;
  }
  return b;
}

template <class T>
void dump(const std::string& dir, const std::string& scenario, const char* backend,
          const char* name, const std::vector<T>& v) {
  const std::string path = dir + "/" + scenario + "." + backend + "." + name + ".bin";
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(v.data(), sizeof(T), v.size(), f) != v.size()) {
    std::fprintf(stderr, "harness: cannot write %s\n", path.c_str());
    std::exit(2);
  }
  std::fclose(f);
}

void dump_all(const std::string& dir, const std::string& scenario, const char* backend,
              const Scratch& s) {
  dump(dir, scenario, backend, "ids", s.ids);
  dump(dir, scenario, backend, "weights", s.weights);
  dump(dir, scenario, backend, "pred1", s.pred1);
  dump(dir, scenario, backend, "pred2", s.pred2);
  dump(dir, scenario, backend, "plan", s.plan);
  dump(dir, scenario, backend, "h", s.h);
  dump(dir, scenario, backend, "y", s.y);
  dump(dir, scenario, backend, "out", s.out);
  dump(dir, scenario, backend, "status", s.status);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 2 && std::string(argv[1]) == "--list") {
    for (const auto& n : strata_shim::kernel_names()) std::printf("%s\n", n.c_str());
    return 0;
  }
  if (argc != 6) {
    std::fprintf(stderr, "usage: shim_harness PACK OUT_DIR ROWS LAYER SEED | --list\n");
    return 2;
  }
  const std::string dir = argv[2];
  const std::uint32_t rows = std::uint32_t(std::atoi(argv[3]));
  const std::uint32_t layer = std::uint32_t(std::atoi(argv[4]));
  const unsigned seed = unsigned(std::atoi(argv[5]));

  strata::PackFile pack(argv[1], false);
  const strata::PackLayout& L = pack.layout();
  const std::uint32_t E = L.n_experts, keys = L.n_keys(), k = L.top_k;
  const std::uint64_t stride = L.record_stride;

  // Arena: every record, slot = keys - 1 - key, so a kernel reading "slot = key" would fail;
  // cut into five views, so the multi-view addressing runs too.

  std::vector<unsigned char> arena(std::size_t(keys) * stride);
  std::vector<std::uint32_t> smap_full(keys);
  for (std::uint32_t key = 0; key < keys; ++key) {
    const std::uint32_t slot = keys - 1 - key;
    std::size_t got = 0;
    if (pack.read_fully(L.record_offset(key), arena.data() + std::size_t(slot) * stride,
                        L.record_bytes, &got) != 0) {
      std::fprintf(stderr, "harness: read of key %u failed\n", key);
      return 2;
    }
    smap_full[key] = slot;
  }
  const std::vector<float> routers = pack.read_routers();
  const auto split = strata::metal::split_arena(stride, keys, ((keys + 4) / 5) * stride);

  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> x(std::size_t(rows) * L.hidden);
  for (float& v : x) v = normal(rng);
  {
    FILE* f = std::fopen((dir + "/x.bin").c_str(), "wb");
    std::fwrite(x.data(), 4, x.size(), f);
    std::fclose(f);
  }

  strata::cpu::ParallelFor serial = [](std::uint32_t n,
                                       const std::function<void(std::uint32_t, std::uint32_t)>& f) {
    f(0, n);
  };
  auto cmd = [&](Op op, std::uint32_t l, Pass pass = Pass::Resident, std::uint32_t distance = 0) {
    Command c;
    c.op = op;
    c.layer = l;
    c.rows = rows;
    c.pass = pass;
    c.distance = distance;
    return c;
  };

  // One scenario: `steps` runs against both backends on fresh scratch and its own smap copy;
  // `between` may edit smap/wave between steps (host work at a handshake).
  struct Step {
    Command c;
    std::function<void(std::vector<std::uint32_t>&, Scratch&)> host;
  };
  auto scenario = [&](const std::string& name, const std::vector<std::uint32_t>& smap0,
                      const std::vector<Step>& steps) {
    for (const char* backend : {"cpu", "metal"}) {
      std::vector<std::uint32_t> smap = smap0;
      Scratch s;
      alloc(s, L, rows);
      s.x = x;
      DeviceBuffers b = cpu_view(s, L, arena.data(), stride, keys, smap.data(), routers.data(), rows);
      MetalSide m{strata::metal::DispatchPlanner(L, stride, keys, split.slots_per_view),
                  metal_bindings(s, smap.data(), routers.data(), arena.data(), stride, split)};
      const bool cpu = std::string(backend) == "cpu";
      for (const Step& st : steps) {
        if (st.host) st.host(smap, s);
        const Command& c = st.c;
        if (!cpu) {
          m.run(c);
          continue;
        }
        bool ok = true;
        switch (c.op) {
          case Op::Route:
            strata::cpu::route(b, c.layer, rows, b.ids, b.weights, serial);
            break;
          case Op::RoutePredict:
            strata::cpu::route(b, c.layer, rows, b.pred_ids[c.distance - 1], nullptr, serial);
            break;
          case Op::Plan:
            strata::cpu::plan(b, c.layer, rows);
            break;
          case Op::GateUp:
            ok = strata::cpu::gate_up(b, c.layer, rows, c.pass, serial);
            break;
          case Op::Down:
            ok = strata::cpu::down(b, c.layer, rows, c.pass, serial);
            break;
          case Op::MoeMM:
            ok = strata::cpu::moe_mm(b, c.layer, rows, serial);
            break;
          case Op::Combine:
            strata::cpu::combine(b, rows, serial);
            break;
          default:
            break;
        }
        if (!ok) s.status[STRATA_STATUS_ERROR] = STRATA_ERROR_ABSENT;
      }
      dump_all(dir, name, backend, s);
    }
  };

  const std::uint32_t L1 = layer + 1 < L.n_layers ? layer + 1 : layer;
  const std::uint32_t L2 = layer + 2 < L.n_layers ? layer + 2 : layer;
  // decode: everything resident, the full per-layer sequence.
  scenario("decode", smap_full,
           {{cmd(Op::Route, layer), {}},
            {cmd(Op::RoutePredict, L1, Pass::Resident, 1), {}},
            {cmd(Op::RoutePredict, L2, Pass::Resident, 2), {}},
            {cmd(Op::Plan, layer), {}},
            {cmd(Op::GateUp, layer, Pass::Resident), {}},
            {cmd(Op::Down, layer, Pass::Resident), {}},
            {cmd(Op::GateUp, layer, Pass::Missing), {}},
            {cmd(Op::Down, layer, Pass::Missing), {}},
            {cmd(Op::Combine, layer), {}}});

  // split: odd experts absent when the plan runs, published before the missing pass.
  std::vector<std::uint32_t> smap_odd = smap_full;
  for (std::uint32_t e = 1; e < E; e += 2) smap_odd[layer * E + e] = strata::kAbsent;
  auto publish = [&](std::vector<std::uint32_t>& sm, Scratch&) { sm = smap_full; };
  scenario("split", smap_odd,
           {{cmd(Op::Route, layer), {}},
            {cmd(Op::Plan, layer), {}},
            {cmd(Op::GateUp, layer, Pass::Resident), {}},
            {cmd(Op::Down, layer, Pass::Resident), {}},
            {cmd(Op::GateUp, layer, Pass::Missing), publish},
            {cmd(Op::Down, layer, Pass::Missing), {}},
            {cmd(Op::Combine, layer), {}}});

  // wave: the prompt path, the routed experts in two waves (even experts, then odd ones).
  auto wave_of = [&](int parity) {
    return [&, parity](std::vector<std::uint32_t>&, Scratch& s) {
      std::set<std::int32_t> experts(s.ids.begin(), s.ids.end());
      std::uint32_t n = 0;
      for (std::int32_t e : experts)
        if (e % 2 == parity) s.wave[n++] = e;
      s.wave_n[0] = n;
    };
  };
  scenario("wave", smap_full,
           {{cmd(Op::Route, layer), {}},
            {cmd(Op::MoeMM, layer), wave_of(0)},
            {cmd(Op::MoeMM, layer), wave_of(1)},
            {cmd(Op::Combine, layer), {}}});

  // absent: an odd expert never published; the missing pass must flag it, not compute.
  scenario("absent", smap_odd,
           {{cmd(Op::Route, layer), {}},
            {cmd(Op::Plan, layer), {}},
            {cmd(Op::GateUp, layer, Pass::Missing), {}},
            {cmd(Op::Down, layer, Pass::Missing), {}}});
  (void)k;
  return 0;
}
