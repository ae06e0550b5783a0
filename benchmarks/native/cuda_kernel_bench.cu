// The CUDA backend's decode kernels alone, at Qwen3-30B-A3B expert shapes (hidden 2048,
// moe_intermediate 768, 128 experts, top-8, q4 group 64 with f16 scales), timed with CUDA events
// around each launch (median of N), beside the device-to-device copy bandwidth that gives the
// HBM roofline. Built against csrc/cuda/kernels (or another commit's copy of it: the launchers
// of kernels.h are the interface), so a before/after pair is two builds of this one file:
//   nvcc -std=c++20 -O3 -arch=sm_90 -I<dir above kernels> -Icsrc/engine -o bench \
//     benchmarks/native/cuda_kernel_bench.cu <kernels>/route.cu <kernels>/experts.cu
//   ./bench [--dump FILE] [--json FILE]
// One decode token (a route launch with its two predictions: three routers; gate_up, down and
// combine over 8 groups of one entry, each group a different expert of 128 in a 340 MB arena, the
// experts rotating so that every launch reads its weights from HBM, not L2). --dump writes every
// output (ids, weights, h, y, out of one fixed token) so that two builds can be compared bitwise.
// It also runs the same token inside an 8-row batch (the staged kernels) and checks that its h
// and y are bitwise the decode kernels' (I11 across batch sizes).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/kernels.h"

using namespace strata::cuda;

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e_ = (x);                                                       \
    if (e_ != cudaSuccess) {                                                    \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,            \
                   cudaGetErrorString(e_));                                     \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)

namespace {

constexpr std::uint32_t H = 2048, I = 768, E = 128, K = 8, G = 64, kSlots = 128;

// The route kernel's scratch, where this build's kernels have it (DevBuffers::route_done).
template <class B>
auto set_route_scratch(B& b, float* logits, std::uint32_t* done, int)
    -> decltype(b.route_done, void()) {
  b.logits = logits;
  b.route_done = done;
}
template <class B>
void set_route_scratch(B&, float*, std::uint32_t*, long) {}

// The host's copy of the group table, where this build's kernels take it
// (DevBuffers::host_groups: the groups as kernel arguments); false where they do not.
template <class B>
auto set_host_groups(B& b, const std::uint32_t* g, int) -> decltype(b.host_groups, bool()) {
  b.host_groups = g;
  return true;
}
template <class B>
bool set_host_groups(B&, const std::uint32_t*, long) {
  return false;
}

std::size_t align256(std::size_t n) { return (n + 255) / 256 * 256; }

template <class T>
T* dev_alloc(std::size_t n) {
  void* p = nullptr;
  CK(cudaMalloc(&p, n * sizeof(T) + 256));
  CK(cudaMemset(p, 0, n * sizeof(T) + 256));
  return static_cast<T*>(p);
}

template <class T>
void upload(T* d, const std::vector<T>& h) {
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
}

template <class T>
std::vector<T> download(const T* d, std::size_t n) {
  std::vector<T> h(n);
  CK(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

// Holds its stream until the host sets *go (or about a second has passed), so that every launch
// queued behind it is in the GPU's queue before the first one starts: an event pair around those
// launches then times the GPU's work alone, not the host's launch calls (nvbench's blocking
// kernel). Without it a sequence of short kernels from an idle GPU is timed at the rate the host
// issues them.
__global__ void hold_kernel(const volatile int* go) {
  const long long t0 = clock64();
  while (*go == 0 && clock64() - t0 < (1ll << 31)) {
  }
}

double median(std::vector<double>& v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timer {
  cudaEvent_t a, b;
  int* go_host = nullptr;  // pinned, mapped: hold_kernel's flag
  int* go_dev = nullptr;
  Timer() {
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    CK(cudaHostAlloc(reinterpret_cast<void**>(&go_host), sizeof(int), cudaHostAllocMapped));
    CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&go_dev), go_host, 0));
  }
  // An event pair around launch()'s kernels; release() runs once both are queued, before the
  // wait for the second.
  template <class F, class Release>
  double pair_us(F&& launch, cudaStream_t s, Release&& release) {
    CK(cudaEventRecord(a, s));
    launch();
    CK(cudaEventRecord(b, s));
    release();
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms * 1e3;
  }
  template <class F>
  double once_us(F&& launch, cudaStream_t s) {
    return pair_us(launch, s, [] {});
  }
  // The GPU's time for launch()'s kernels, queued behind hold_kernel.
  template <class F>
  double held_us(F&& launch, cudaStream_t s) {
    *reinterpret_cast<volatile int*>(go_host) = 0;
    hold_kernel<<<1, 1, 0, s>>>(go_dev);
    CK(cudaGetLastError());
    return pair_us(launch, s, [this] {
      __atomic_thread_fence(__ATOMIC_SEQ_CST);
      *reinterpret_cast<volatile int*>(go_host) = 1;
    });
  }
  // The median of n launches after 3 unmeasured ones; launch(i) gets the launch's index.
  template <class F>
  double median_us(int n, F&& launch, cudaStream_t s) {
    std::vector<double> us;
    for (int i = 0; i < n + 3; ++i) {
      const double t = once_us([&] { launch(i); }, s);
      if (i >= 3) us.push_back(t);
    }
    return median(us);
  }
};

}  // namespace

int main(int argc, char** argv) {
  const char *dump = nullptr, *json = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--dump" && i + 1 < argc) dump = argv[++i];
    if (std::string(argv[i]) == "--json" && i + 1 < argc) json = argv[++i];
  }
  CK(cudaSetDevice(0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  // The record: gate, up, down, each words then scales then biases (q4 g64, f16 scales).
  DevLayout L;
  L.n_experts = E, L.top_k = K, L.hidden = H, L.inter = I;
  L.routing = 0, L.norm_topk = 1, L.format = 3, L.group_size = G, L.scale_format = 1;
  std::size_t off = 0;
  for (int m = 0; m < 3; ++m) {
    const std::uint32_t rows = m == 2 ? H : I, cols = m == 2 ? I : H;
    L.m[m].rows = rows, L.m[m].cols = cols;
    L.m[m].weight = off;
    off = align256(off + std::size_t(rows) * cols / 2);
    L.m[m].scales = off;
    off = align256(off + std::size_t(rows) * (cols / G) * 2);
    L.m[m].biases = off;
    off = align256(off + std::size_t(rows) * (cols / G) * 2);
  }
  const std::size_t record = off, slot = (record + 16383) / 16384 * 16384;
  std::mt19937 rng(7);
  std::vector<unsigned char> host_arena(slot * kSlots);
  for (std::uint32_t sl = 0; sl < kSlots; ++sl) {
    unsigned char* r = host_arena.data() + sl * slot;
    for (int m = 0; m < 3; ++m) {
      const std::size_t words = std::size_t(L.m[m].rows) * L.m[m].cols / 8;
      auto* w = reinterpret_cast<std::uint32_t*>(r + L.m[m].weight);
      for (std::size_t q = 0; q < words; ++q) w[q] = rng();
      const std::size_t groups = std::size_t(L.m[m].rows) * (L.m[m].cols / G);
      auto* sc = reinterpret_cast<std::uint16_t*>(r + L.m[m].scales);
      auto* bi = reinterpret_cast<std::uint16_t*>(r + L.m[m].biases);
      for (std::size_t q = 0; q < groups; ++q) {
        sc[q] = std::uint16_t(0x2000 | (rng() & 0x3FF));  // [2^-7, 2^-6)
        bi[q] = std::uint16_t(0xA400 | (rng() & 0x3FF));  // about -8 scales
      }
    }
  }
  const std::uint32_t max_rows = 8;
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<float> routers(std::size_t(3) * E * H), x(std::size_t(max_rows) * H);
  for (float& v : routers) v = uni(rng);
  for (float& v : x) v = uni(rng);
  for (std::uint32_t t = 1; t < max_rows; ++t)  // the batch: the same token, 8 times
    std::copy(x.begin(), x.begin() + H, x.begin() + t * H);

  DevBuffers b;
  auto* arena = dev_alloc<unsigned char>(host_arena.size());
  upload(arena, host_arena);
  b.arena = arena, b.slot_bytes = slot, b.n_slots = kSlots;
  auto* d_routers = dev_alloc<float>(routers.size());
  upload(d_routers, routers);
  b.routers = d_routers;
  b.x = dev_alloc<float>(x.size());
  upload(b.x, x);
  b.ids = dev_alloc<std::int32_t>(max_rows * K);
  b.weights = dev_alloc<float>(max_rows * K);
  b.pred_ids[0] = dev_alloc<std::int32_t>(max_rows * K);
  b.pred_ids[1] = dev_alloc<std::int32_t>(max_rows * K);
  set_route_scratch(b, dev_alloc<float>(3 * max_rows * E), dev_alloc<std::uint32_t>(3 * max_rows),
                    0);
  b.h = dev_alloc<float>(std::size_t(max_rows) * K * I);
  b.y = dev_alloc<float>(std::size_t(max_rows) * K * H);
  b.out = dev_alloc<float>(std::size_t(max_rows) * H);
  std::uint32_t* g = dev_alloc<std::uint32_t>(1 + 8 * E + max_rows * K);
  b.groups_n = g, b.group_slot = g + 1, b.group_start = g + 1 + E, b.group_count = g + 1 + 2 * E;
  b.group_entries = g + 1 + 8 * E;
  CK(prepare_kernels(L));
  CK(prepare_route(L));

  RouteTasks tasks;
  tasks.t[0] = RouteTask{0, b.ids, b.weights, nullptr, nullptr};
  tasks.t[1] = RouteTask{1, b.pred_ids[0], nullptr, nullptr, nullptr};
  tasks.t[2] = RouteTask{2, b.pred_ids[1], nullptr, nullptr, nullptr};
  tasks.n = 3;

  // Decode groups: entry j alone in group j, at slot first + j. In the device table and, where
  // the kernels take them (and host_groups_on), as kernel arguments.
  std::vector<std::uint32_t> hg(1 + 8 * E + max_rows * K, 0);
  bool host_groups_on = true;
  auto set_groups = [&](std::uint32_t rows, std::uint32_t first) {
    std::fill(hg.begin(), hg.end(), 0u);
    hg[0] = K;
    for (std::uint32_t j = 0; j < K; ++j) {
      hg[1 + j] = (first + j) % kSlots;
      hg[1 + E + j] = j * rows;
      hg[1 + 2 * E + j] = rows;
      for (std::uint32_t t = 0; t < rows; ++t) hg[1 + 8 * E + j * rows + t] = t * K + j;
    }
    upload(g, hg);
    set_host_groups(b, host_groups_on ? hg.data() : nullptr, 0);
  };
  const bool has_host_groups = set_host_groups(b, nullptr, 0);

  // Device-to-device copy bandwidth (read + write bytes), 1 GiB each way, median of 5.
  const std::size_t big = std::size_t(1) << 30;
  void *src = nullptr, *dst = nullptr;
  CK(cudaMalloc(&src, big));
  CK(cudaMalloc(&dst, big));
  Timer tm;
  const double copy_us =
      tm.median_us(5, [&](int) { CK(cudaMemcpyAsync(dst, src, big, cudaMemcpyDeviceToDevice, s)); },
                   s);
  const double d2d = 2.0 * big / (copy_us * 1e-6);
  CK(cudaFree(src));
  CK(cudaFree(dst));
  std::printf("device-to-device copy: %.0f GB/s (read + write)\n", d2d / 1e9);

  // x as the backend stages it for a decode token: pinned host memory mapped into the GPU.
  float* x_host = nullptr;
  CK(cudaHostAlloc(reinterpret_cast<void**>(&x_host), H * 4, cudaHostAllocMapped));
  std::copy(x.begin(), x.begin() + H, x_host);
  float* x_staged = nullptr;
  CK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&x_staged), x_host, 0));

  const int N = 200;
  const double staged_us = tm.median_us(
      N, [&](int) { CK(launch_route(L, b, 1, tasks, x_staged, s)); }, s);
  const double route_us = tm.median_us(
      N, [&](int) { CK(launch_route(L, b, 1, tasks, nullptr, s)); }, s);
  // Each timed launch reads experts no launch of the last 7 read (128 slots, 16 a step): HBM.
  // Medians of gate_up's and down's launch times, each launch on its own groups.
  auto time_experts = [&](double* gu_us, double* dn_us) {
    std::vector<double> gus, dns;
    for (int i = 0; i < N; ++i) {
      set_groups(1, std::uint32_t(i) * 2 * K);
      gus.push_back(tm.once_us([&] { CK(launch_gate_up(L, b, 1, s)); }, s));
      set_groups(1, std::uint32_t(i) * 2 * K + K);
      dns.push_back(tm.once_us([&] { CK(launch_down(L, b, 1, s)); }, s));
    }
    *gu_us = median(gus);
    *dn_us = median(dns);
  };
  double gu_us = 0, dn_us = 0;
  time_experts(&gu_us, &dn_us);
  // The same with the groups read from the device table (the mapped arena's way), for comparison.
  double gu_tbl_us = 0, dn_tbl_us = 0;
  if (has_host_groups) {
    host_groups_on = false;
    time_experts(&gu_tbl_us, &dn_tbl_us);
    host_groups_on = true;
  }
  const double combine_us = tm.median_us(N, [&](int) { CK(launch_combine(L, b, 1, s)); }, s);
  // A decode layer's launches back to back, one event pair around them: x's copy and the route
  // (with both predictions), gate_up, down and combine over 8 experts no recent launch read.
  // (The backend has a host crossing between the route and gate_up; this is the kernels alone,
  // launch gaps included.) And the expert launches alone: gate_up, down, combine.
  // The same again queued behind hold_kernel (layer_gpu, experts_gpu): the GPU's time alone,
  // without the host's launch calls, which the backend issues ahead of the GPU in a decode step.
  double layer_seq_us = 0, experts_seq_us = 0, layer_gpu_us = 0, experts_gpu_us = 0;
  double route_gpu_us = 0, gu_gpu_us = 0, dn_gpu_us = 0;
  {
    std::vector<double> ls, es, lg, eg, rg, gg, dg;
    auto layer = [&] {
      CK(launch_route(L, b, 1, tasks, x_staged, s));
      CK(launch_gate_up(L, b, 1, s));
      CK(launch_down(L, b, 1, s));
      CK(launch_combine(L, b, 1, s));
    };
    auto experts = [&] {
      CK(launch_gate_up(L, b, 1, s));
      CK(launch_down(L, b, 1, s));
      CK(launch_combine(L, b, 1, s));
    };
    for (int i = 0; i < N; ++i) {
      set_groups(1, std::uint32_t(i) * K);
      ls.push_back(tm.once_us(layer, s));
      set_groups(1, std::uint32_t(i) * K + 64);
      es.push_back(tm.once_us(experts, s));
      set_groups(1, std::uint32_t(i) * K + 32);
      lg.push_back(tm.held_us(layer, s));
      set_groups(1, std::uint32_t(i) * K + 96);
      eg.push_back(tm.held_us(experts, s));
      rg.push_back(tm.held_us([&] { CK(launch_route(L, b, 1, tasks, x_staged, s)); }, s));
      set_groups(1, std::uint32_t(i) * K + 16);
      gg.push_back(tm.held_us([&] { CK(launch_gate_up(L, b, 1, s)); }, s));
      set_groups(1, std::uint32_t(i) * K + 80);
      dg.push_back(tm.held_us([&] { CK(launch_down(L, b, 1, s)); }, s));
    }
    layer_seq_us = median(ls), experts_seq_us = median(es);
    layer_gpu_us = median(lg), experts_gpu_us = median(eg);
    route_gpu_us = median(rg), gu_gpu_us = median(gg), dn_gpu_us = median(dg);
  }
  const double gu_bytes = double(K) * 2 * (L.m[1].weight - L.m[0].weight);
  const double dn_bytes = double(K) * (record - L.m[2].weight);
  const double route_bytes = 3.0 * E * H * 4;
  auto line = [&](const char* name, double us, double bytes) {
    std::printf("%-8s %7.1f us  %6.2f MB  %6.2f TB/s  %.2f of the roofline\n", name, us,
                bytes / 1e6, bytes / (us * 1e-6) / 1e12, bytes / d2d / (us * 1e-6));
  };
  line("route_xs", staged_us, route_bytes);  // x read from the mapped staging
  line("route", route_us, route_bytes);
  line("gate_up", gu_us, gu_bytes);
  line("down", dn_us, dn_bytes);
  line("combine", combine_us, double(K) * H * 4 + H * 4);
  line("layer", route_us + gu_us + dn_us + combine_us, route_bytes + gu_bytes + dn_bytes);
  line("layer_seq", layer_seq_us, route_bytes + gu_bytes + dn_bytes);
  line("experts_seq", experts_seq_us, gu_bytes + dn_bytes);
  line("route_gpu", route_gpu_us, route_bytes);
  line("gate_up_gpu", gu_gpu_us, gu_bytes);
  line("down_gpu", dn_gpu_us, dn_bytes);
  line("layer_gpu", layer_gpu_us, route_bytes + gu_bytes + dn_bytes);
  line("experts_gpu", experts_gpu_us, gu_bytes + dn_bytes);
  if (has_host_groups) {
    line("gate_up_tbl", gu_tbl_us, gu_bytes);
    line("down_tbl", dn_tbl_us, dn_bytes);
  }
  if (json) {
    FILE* f = std::fopen(json, "w");
    std::fprintf(f,
                 "{\"d2d_gb_s\": %.1f, \"route_staged_x_us\": %.2f, \"route_us\": %.2f, "
                 "\"gate_up_us\": %.2f, \"down_us\": %.2f, \"combine_us\": %.2f, "
                 "\"layer_seq_us\": %.2f, \"experts_seq_us\": %.2f, "
                 "\"route_gpu_us\": %.2f, \"gate_up_gpu_us\": %.2f, \"down_gpu_us\": %.2f, "
                 "\"layer_gpu_us\": %.2f, \"experts_gpu_us\": %.2f, "
                 "\"route_bytes\": %.0f, \"gate_up_bytes\": %.0f, \"down_bytes\": %.0f}\n",
                 d2d / 1e9, staged_us, route_us, gu_us, dn_us, combine_us, layer_seq_us,
                 experts_seq_us, route_gpu_us, gu_gpu_us, dn_gpu_us, layer_gpu_us,
                 experts_gpu_us, route_bytes, gu_bytes, dn_bytes);
    std::fclose(f);
  }

  // Outputs of one fixed decode token (slots 0..7), then the same token in an 8-row batch.
  set_groups(1, 0);
  CK(launch_route(L, b, 1, tasks, nullptr, s));
  CK(launch_gate_up(L, b, 1, s));
  CK(launch_down(L, b, 1, s));
  CK(launch_combine(L, b, 1, s));
  CK(cudaStreamSynchronize(s));
  const auto ids = download(b.ids, K), p1 = download(b.pred_ids[0], K),
             p2 = download(b.pred_ids[1], K);
  const auto wts = download(b.weights, K);
  const auto h1 = download(b.h, std::size_t(K) * I), y1 = download(b.y, std::size_t(K) * H),
             o1 = download(b.out, H);
  std::printf("ids");
  for (auto v : ids) std::printf(" %d", v);
  std::printf("  pred1");
  for (auto v : p1) std::printf(" %d", v);
  std::printf("  weights");
  for (auto v : wts) std::printf(" %.6f", v);
  std::printf("\n");
  // The batch: weights as the decode token's for every row (down scales by them).
  std::vector<float> wb(max_rows * K);
  for (std::uint32_t t = 0; t < max_rows; ++t)
    std::copy(wts.begin(), wts.end(), wb.begin() + t * K);
  upload(b.weights, wb);
  set_groups(max_rows, 0);
  CK(launch_gate_up(L, b, max_rows, s));
  CK(launch_down(L, b, max_rows, s));
  CK(cudaStreamSynchronize(s));
  const auto hb = download(b.h, std::size_t(max_rows) * K * I),
             yb = download(b.y, std::size_t(max_rows) * K * H);
  bool same = true;
  for (std::uint32_t t = 0; t < max_rows; ++t) {
    same = same && std::memcmp(hb.data() + t * K * I, h1.data(), K * I * 4) == 0;
    same = same && std::memcmp(yb.data() + t * K * H, y1.data(), K * H * 4) == 0;
  }
  std::printf("decode (direct) and 8-row batch (staged) h, y: %s\n",
              same ? "bitwise equal" : "DIFFERENT");
  if (has_host_groups) {  // the decode token again, its groups read from the device table
    upload(b.weights, wts);
    host_groups_on = false;
    set_groups(1, 0);
    CK(launch_gate_up(L, b, 1, s));
    CK(launch_down(L, b, 1, s));
    CK(launch_combine(L, b, 1, s));
    CK(cudaStreamSynchronize(s));
    auto bits = [](const std::vector<float>& a, const std::vector<float>& c) {
      return a.size() == c.size() && std::memcmp(a.data(), c.data(), a.size() * 4) == 0;
    };
    const bool tbl = bits(download(b.h, std::size_t(K) * I), h1) &&
                     bits(download(b.y, std::size_t(K) * H), y1) && bits(download(b.out, H), o1);
    std::printf("decode with the groups as arguments and from the table: %s\n",
                tbl ? "bitwise equal" : "DIFFERENT");
    same = same && tbl;
  }
  if (dump) {
    FILE* f = std::fopen(dump, "wb");
    std::fwrite(ids.data(), 4, K, f);
    std::fwrite(p1.data(), 4, K, f);
    std::fwrite(p2.data(), 4, K, f);
    std::fwrite(wts.data(), 4, K, f);
    std::fwrite(h1.data(), 4, h1.size(), f);
    std::fwrite(y1.data(), 4, y1.size(), f);
    std::fwrite(o1.data(), 4, o1.size(), f);
    std::fclose(f);
  }
  return same ? 0 : 2;
}
