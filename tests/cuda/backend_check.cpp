// The CUDA backend driven directly through the Backend interface, against the CPU backend on
// the same buffers (ggml test-backend-ops style), and its error path: a missing pass whose
// expert has no published slot is reported by take_device_error(), computes nothing, and the
// backend runs the next submission normally.
//   strata_cuda_check PACK    (exit 0: all checks passed)
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "exec/backend.h"
#include "host/cuda_backend.h"
#include "pack/pack_file.h"
#include "residency/slot.h"

using namespace strata;

namespace {

int failures = 0;
void expect(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAIL", what.c_str());
  if (!ok) ++failures;
}

struct Buffers {
  std::vector<float> x, weights, logits, h, y, out, moce_moved;
  std::vector<std::int32_t> ids, pred[2], wave;
  std::vector<std::uint32_t> plan, wave_n, moce_changed, resident;
  DeviceBuffers b;
};

Command cmd(Op op, std::uint32_t rows, Pass pass = Pass::Resident) {
  Command c{};
  c.op = op;
  c.layer = 0;
  c.rows = rows;
  c.pass = pass;
  return c;
}

// Decode layer 0: plan, resident pass, missing pass, combine; returns the take_device_error().
std::string run(Backend& be, std::uint32_t rows, SharedEvent& ev, std::uint64_t v) {
  Command sig = cmd(Op::Signal, 0);
  sig.event = &ev;
  sig.value = v;
  be.submit({cmd(Op::Plan, rows), cmd(Op::GateUp, rows), cmd(Op::Down, rows),
             cmd(Op::GateUp, rows, Pass::Missing), cmd(Op::Down, rows, Pass::Missing),
             cmd(Op::Combine, rows), sig});
  ev.wait(v);
  be.synchronize();
  return be.take_device_error();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: strata_cuda_check PACK\n");
    return 2;
  }
  PackFile pack(argv[1], false);
  const PackLayout& L = pack.layout();
  const std::uint32_t k = L.top_k, H = L.hidden, I = L.moe_intermediate, E = L.n_experts;
  const std::uint32_t rows = 2, n_slots = 2 * k;
  // Host memory laid out as ExpertStream lays it out: page-aligned arena and slot map.
  const std::size_t arena_bytes = std::size_t(n_slots) * L.record_stride;
  auto* arena = static_cast<unsigned char*>(std::aligned_alloc(kPage, arena_bytes));
  const std::size_t smap_bytes = (std::size_t(L.n_keys()) * 4 + kPage - 1) / kPage * kPage;
  auto* smap = static_cast<std::uint32_t*>(std::aligned_alloc(kPage, smap_bytes));
  for (std::size_t i = 0; i < smap_bytes / 4; ++i) smap[i] = kAbsent;
  std::vector<float> routers = pack.read_routers();

  Buffers s;
  const std::size_t R = rows;
  s.x.resize(R * H);
  for (std::size_t i = 0; i < s.x.size(); ++i) s.x[i] = std::sin(0.37f * float(i) + 0.1f);
  s.ids.resize(R * k);
  s.weights.resize(R * k);
  for (std::uint32_t t = 0; t < rows; ++t)
    for (std::uint32_t j = 0; j < k; ++j) {
      s.ids[t * k + j] = std::int32_t((t + 2 * j) % E);
      s.weights[t * k + j] = 1.0f / float(j + 1 + t);
    }
  s.pred[0].resize(R * k);
  s.pred[1].resize(R * k);
  s.logits.resize(R * E);
  s.plan.resize(R * k);
  s.h.resize(R * k * I);
  s.y.resize(R * k * H);
  s.out.assign(R * H, NAN);
  s.wave.resize(E);
  s.wave_n.assign(1, 0);
  s.moce_moved.resize(R);
  s.moce_changed.resize(R);
  s.resident.resize(E);
  DeviceBuffers& b = s.b;
  b.layout = &L;
  b.arena = arena;
  b.slot_bytes = L.record_stride;
  b.n_slots = n_slots;
  b.smap = smap;
  b.routers = routers.empty() ? nullptr : routers.data();
  b.max_rows = rows;
  b.x = s.x.data();
  b.ids = s.ids.data();
  b.weights = s.weights.data();
  b.pred_ids[0] = s.pred[0].data();
  b.pred_ids[1] = s.pred[1].data();
  b.logits = s.logits.data();
  b.plan = s.plan.data();
  b.h = s.h.data();
  b.y = s.y.data();
  b.out = s.out.data();
  b.wave = s.wave.data();
  b.wave_n = s.wave_n.data();
  b.moce_moved = s.moce_moved.data();
  b.moce_changed = s.moce_changed.data();
  b.route_resident = s.resident.data();

  auto cuda = cuda::make_cuda_backend();
  cuda->bind(b);
  SharedEvent ev;

  // 1. Nothing published: the plan finds every expert missing, and the missing pass must
  //    report the first one instead of computing with whatever a slot holds.
  std::string err = run(*cuda, rows, ev, 1);
  expect(err.find("has no published slot") != std::string::npos,
         "an unpublished expert in the missing pass is reported (got '" + err + "')");
  expect(cuda->take_device_error().empty(), "the error is reported once");

  // 2. Publish the routed experts (slots 0.. in first-use order), half of them before the plan:
  //    both passes run; the output must match the CPU backend's on the same buffers.
  std::vector<std::int32_t> slot_of(E, -1);
  std::uint32_t next = 0;
  for (std::int32_t e : s.ids) {
    if (slot_of[std::size_t(e)] >= 0) continue;
    slot_of[std::size_t(e)] = std::int32_t(next);
    std::size_t got = 0;
    const int rc = pack.read_fully(L.record_offset(std::uint32_t(e)),
                                   arena + std::size_t(next) * L.record_stride, L.record_bytes,
                                   &got);
    expect(rc == 0, "record " + std::to_string(e) + " read");
    smap[std::uint32_t(e)] = next++;
  }
  err = run(*cuda, rows, ev, 2);
  expect(err.empty(), "the backend runs normally after a reported error (got '" + err + "')");
  const std::vector<float> got = s.out;
  auto cpu = make_cpu_backend(1);
  cpu->bind(b);
  SharedEvent ev_cpu;
  err = run(*cpu, rows, ev_cpu, 1);
  expect(err.empty(), "the CPU reference runs");
  float worst = 0, scale = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    scale = std::fmax(scale, std::fabs(s.out[i]));
    worst = std::fmax(worst, std::isfinite(got[i]) ? std::fabs(got[i] - s.out[i]) : INFINITY);
  }
  expect(worst <= 1e-5f * scale + 1e-6f, "cuda matches cpu: max |diff| " + std::to_string(worst) +
                                             " at scale " + std::to_string(scale));
  cuda.reset();
  cpu.reset();
  std::free(arena);
  std::free(smap);
  std::printf("%s\n", failures ? "strata_cuda_check: FAILED" : "strata_cuda_check: passed");
  return failures ? 1 : 0;
}
