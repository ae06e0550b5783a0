#include "kernel_bench.h"

#include <algorithm>
#include <chrono>
#include <numeric>
#include <random>
#include <set>

#include "common/errors.h"
#include "exec/scratch.h"

namespace strata {
namespace {

template <class Fn>
double median_seconds(std::uint32_t repeats, Fn fn) {
  std::vector<double> t;
  for (std::uint32_t r = 0; r < std::max(1u, repeats); ++r) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

Command op(Op o, std::uint32_t layer, std::uint32_t rows, Pass pass = Pass::Resident) {
  Command c{};
  c.op = o;
  c.layer = layer;
  c.rows = rows;
  c.pass = pass;
  return c;
}

}  // namespace

std::vector<KernelTiming> bench_kernels(ExpertStream& stream, Backend& backend,
                                        std::uint32_t layer, std::uint32_t rows,
                                        std::uint32_t repeats, std::uint32_t seed) {
  const PackLayout& L = stream.layout();
  if (stream.n_slots() < L.n_experts)
    throw EngineError(ErrorKind::Config, "bench_kernels needs an arena holding a whole layer (" +
                                             std::to_string(L.n_experts) + " slots)");
  std::vector<std::int32_t> all(L.n_experts);
  std::iota(all.begin(), all.end(), 0);
  stream.wait(layer, all.data(), all.size());

  std::vector<float> routers = stream.file().read_routers();
  Scratch scratch(stream, routers.data());
  scratch.ensure(rows);
  const DeviceBuffers& b = scratch.buffers();
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  for (std::size_t i = 0; i < std::size_t(rows) * L.hidden; ++i) b.x[i] = nd(rng);
  backend.bind(b);
  auto run = [&](Command c) {
    backend.submit({c});
    backend.synchronize();
  };

  const double T = rows, k = L.top_k, H = L.hidden, I = L.moe_intermediate, E = L.n_experts;
  // A pack whose model routes itself (routing external) holds no routers: the rows take
  // distinct random experts instead, and there is no route kernel to time.
  const bool routes = L.has_routers();
  if (routes) {
    run(op(Op::Route, layer, rows));
  } else {
    std::vector<std::int32_t> pick(L.n_experts);
    std::iota(pick.begin(), pick.end(), 0);
    for (std::uint32_t t = 0; t < rows; ++t) {
      std::shuffle(pick.begin(), pick.end(), rng);
      for (std::uint32_t j = 0; j < L.top_k; ++j) {
        b.ids[std::size_t(t) * L.top_k + j] = pick[j];
        b.weights[std::size_t(t) * L.top_k + j] = 1.0f / float(L.top_k);
      }
    }
  }
  std::set<std::int32_t> unique(b.ids, b.ids + rows * L.top_k);
  const double U = double(unique.size());
  std::copy(unique.begin(), unique.end(), b.wave);
  *b.wave_n = std::uint32_t(unique.size());
  const double matrix_bytes = double(L.record_bytes) / 3;  // gate, up and down are equal-sized
  std::vector<KernelTiming> out;
  if (routes)
    out.push_back({"route", median_seconds(repeats, [&] { run(op(Op::Route, layer, rows)); }),
                   2 * T * E * H, E * H * 4});
  out.push_back({"plan", median_seconds(repeats, [&] { run(op(Op::Plan, layer, rows)); }), 0, 0});
  out.push_back({"gate_up",
                 median_seconds(repeats, [&] { run(op(Op::GateUp, layer, rows)); }),
                 2 * 2 * T * k * I * H, 2 * U * matrix_bytes});
  out.push_back({"down", median_seconds(repeats, [&] { run(op(Op::Down, layer, rows)); }),
                 2 * T * k * H * I, U * matrix_bytes});
  out.push_back({"moe_mm", median_seconds(repeats, [&] { run(op(Op::MoeMM, layer, rows)); }),
                 3 * 2 * T * k * I * H, 3 * U * matrix_bytes});
  out.push_back({"combine", median_seconds(repeats, [&] { run(op(Op::Combine, layer, rows)); }),
                 T * k * H, 0});
  return out;
}

}  // namespace strata
