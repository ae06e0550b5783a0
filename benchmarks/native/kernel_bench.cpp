#include "kernel_bench.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <thread>

#include "common/errors.h"
#include "exec/scratch.h"
#include "residency/smap.h"

namespace strata {
namespace {

// The sum of `n` words: a plain streaming read (the compiler vectorises it), the result kept so
// the read cannot be dropped.
std::uint64_t sum_words(const std::uint64_t* p, std::size_t n) {
  std::uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  std::size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += p[i];
    s1 += p[i + 1];
    s2 += p[i + 2];
    s3 += p[i + 3];
  }
  for (; i < n; ++i) s0 += p[i];
  return s0 + s1 + s2 + s3;
}

std::atomic<std::uint64_t> g_sink{0};

template <class Fn, class Before>
double median_seconds(std::uint32_t repeats, Fn fn, Before before) {
  std::vector<double> t;
  for (std::uint32_t r = 0; r < std::max(1u, repeats); ++r) {
    before();
    auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <class Fn>
double median_seconds(std::uint32_t repeats, Fn fn) {
  return median_seconds(repeats, fn, [] {});
}

struct Span {
  const std::uint64_t* p;
  std::size_t words;
};

// Seconds `threads` threads take to sum `spans` (thread t takes spans t, t + threads, ...),
// thread start included, as a kernel pass pays its pool's wake-up.
double read_spans(const std::vector<Span>& spans, unsigned threads) {
  std::vector<std::uint64_t> sums(threads);
  auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      for (std::size_t i = t; i < spans.size(); i += threads)
        sums[t] += sum_words(spans[i].p, spans[i].words);
    });
  for (auto& th : pool) th.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (std::uint64_t v : sums) g_sink += v;
  return s;
}

// An expert pass timed beside a plain read of what it reads (`spans`, `span_bytes` of them),
// both from memory (`evict` before each): repeat r reads, evicts, runs the pass. The memory a virtual machine
// shares with its host's other guests gives a bandwidth that moves from second to second, so
// the pass is held to the read made next to it rather than to one measured before the set.
KernelTiming paired_pass(const char* name, double flops, double bytes, std::uint32_t repeats,
                         const std::vector<Span>& spans, double span_bytes, unsigned threads,
                         const std::function<void()>& pass, const std::function<void()>& evict) {
  std::vector<double> pass_s, read_bw, ratio;
  for (std::uint32_t r = 0; r < std::max(1u, repeats); ++r) {
    evict();
    const double read_s = read_spans(spans, threads);
    evict();
    auto t0 = std::chrono::steady_clock::now();
    pass();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    pass_s.push_back(s);
    read_bw.push_back(span_bytes / read_s);
    ratio.push_back((bytes / s) / (span_bytes / read_s));
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  return {name, median(pass_s), flops, bytes, median(read_bw), median(ratio)};
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
                                        std::uint32_t repeats, std::uint32_t seed,
                                        std::uint64_t flush_bytes, unsigned threads) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
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
  std::vector<std::uint64_t> flush(flush_bytes / 8, 1);
  auto evict = [&] { g_sink += sum_words(flush.data(), flush.size()); };
  const double matrix_bytes = double(L.record_bytes) / 3;  // gate, up and down are equal-sized
  std::vector<KernelTiming> out;
  if (routes)
    out.push_back({"route", median_seconds(repeats, [&] { run(op(Op::Route, layer, rows)); }),
                   2 * T * E * H, E * H * 4});
  out.push_back({"plan", median_seconds(repeats, [&] { run(op(Op::Plan, layer, rows)); }), 0, 0});
  // What each pass reads of the chosen experts: the tensors (weights and scales) of its
  // matrices (0 gate, 1 up, 2 down), as 8-byte-word spans of their slots.
  auto spans_of = [&](std::initializer_list<std::uint32_t> matrices) {
    std::vector<Span> spans;
    double bytes = 0;
    for (std::int32_t e : unique) {
      const std::uint32_t slot = smap_load(b.smap, layer * L.n_experts + std::uint32_t(e));
      const unsigned char* base = b.arena + slot * b.slot_bytes;
      for (const TensorEntry& t : L.tensors_of(layer)) {
        if (std::find(matrices.begin(), matrices.end(), t.matrix) == matrices.end()) continue;
        spans.push_back({reinterpret_cast<const std::uint64_t*>(base + t.offset / 8 * 8),
                         std::size_t(t.nbytes / 8)});
        bytes += double(t.nbytes / 8 * 8);
      }
    }
    return std::make_pair(spans, bytes);
  };
  auto paired = [&](const char* name, double flops, double bytes,
                    std::initializer_list<std::uint32_t> matrices, Op o) {
    const auto [spans, span_bytes] = spans_of(matrices);
    out.push_back(paired_pass(name, flops, bytes, repeats, spans, span_bytes, threads,
                              [&] { run(op(o, layer, rows)); }, evict));
  };
  paired("gate_up", 2 * 2 * T * k * I * H, 2 * U * matrix_bytes, {0, 1}, Op::GateUp);
  paired("down", 2 * T * k * H * I, U * matrix_bytes, {2}, Op::Down);
  paired("moe_mm", 3 * 2 * T * k * I * H, 3 * U * matrix_bytes, {0, 1, 2}, Op::MoeMM);
  out.push_back({"combine", median_seconds(repeats, [&] { run(op(Op::Combine, layer, rows)); }),
                 T * k * H, 0});
  return out;
}

double read_bandwidth(std::uint64_t bytes, unsigned threads, std::uint32_t repeats) {
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::uint64_t> buf(bytes / 8, 1);
  const std::size_t share = buf.size() / threads;
  std::vector<std::uint64_t> sums(threads);
  const double s = median_seconds(repeats, [&] {
    std::vector<std::thread> pool;
    for (unsigned i = 0; i < threads; ++i)
      pool.emplace_back([&, i] { sums[i] = sum_words(buf.data() + i * share, share); });
    for (auto& th : pool) th.join();
    for (std::uint64_t v : sums) g_sink += v;
  });
  return double(share * threads * 8) / s;
}

}  // namespace strata
