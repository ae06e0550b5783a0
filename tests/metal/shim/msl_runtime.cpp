// The emulator runs each GPU thread of a threadgroup as its own fiber (ucontext: its own stack
// and control flow) on one OS thread, switching only at simd_sum and threadgroup_barrier. That
// keeps the semantics that matter here - every lane runs the kernel body independently and
// meets the others at the synchronisation points - while costing microseconds, not the
// milliseconds of waking 64 OS threads at every reduction (an OS thread per GPU thread made the
// harness several times slower; `python -m pytest -q tests/metal` times it). Threadgroups are
// independent, so two OS threads take them from a shared counter.
#include "msl_runtime.h"

#include <ucontext.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <thread>

namespace strata_shim {
namespace {

constexpr std::size_t kFiberStack = 128 * 1024;  // kernels keep a few small arrays

// A synchronisation point shared by `n` fibers. Arriving fibers yield until the last one of
// the generation arrives.
struct SyncPoint {
  unsigned n = 0;
  unsigned count = 0;
  std::uint64_t gen = 0;
};

struct SimdGroup {
  SyncPoint sync;
  unsigned lanes = 0;
  float slot[32] = {};  // lane i's value, between the two phases of a reduction
};

struct Fiber {
  ucontext_t ctx{};
  std::unique_ptr<char[]> stack;
  bool done = false;
};

// One OS thread's scheduler: the fibers of the threadgroup it is running.
struct Scheduler {
  ucontext_t main{};
  std::vector<Fiber> fibers;
  std::vector<SimdGroup> simd;
  SyncPoint group;
  unsigned current = 0;
  bool progress = false;
  // The threadgroup being run.
  KernelFn fn = nullptr;
  const KernelParams* p = nullptr;
  const Bindings* b = nullptr;
  const std::uint32_t* threads = nullptr;
  uint3 tg{};
};

thread_local Scheduler* tl_sched = nullptr;

void yield_to_scheduler() {
  Scheduler& s = *tl_sched;
  swapcontext(&s.fibers[s.current].ctx, &s.main);
}

void arrive_and_wait(SyncPoint& sp) {
  const std::uint64_t gen = sp.gen;
  tl_sched->progress = true;
  if (++sp.count == sp.n) {
    sp.count = 0;
    ++sp.gen;
    return;
  }
  while (sp.gen == gen) yield_to_scheduler();
}

void fiber_main() {
  Scheduler& s = *tl_sched;
  const unsigned linear = s.current;
  const std::uint32_t* t = s.threads;
  const uint3 tpos{linear % t[0], (linear / t[0]) % t[1], linear / (t[0] * t[1])};
  auto buf = [&](int i) { return s.b->buffer[i]; };
  s.fn(*s.p, static_cast<const uint*>(buf(STRATA_BUF_SMAP)),
       static_cast<const float*>(buf(STRATA_BUF_ROUTERS)),
       static_cast<const float*>(buf(STRATA_BUF_X)), static_cast<int*>(buf(STRATA_BUF_IDS)),
       static_cast<float*>(buf(STRATA_BUF_WEIGHTS)), static_cast<int*>(buf(STRATA_BUF_PRED1)),
       static_cast<int*>(buf(STRATA_BUF_PRED2)), static_cast<float*>(buf(STRATA_BUF_LOGITS)),
       static_cast<uint*>(buf(STRATA_BUF_PLAN)), static_cast<float*>(buf(STRATA_BUF_H)),
       static_cast<float*>(buf(STRATA_BUF_Y)), static_cast<float*>(buf(STRATA_BUF_OUT)),
       static_cast<const int*>(buf(STRATA_BUF_WAVE)),
       static_cast<const uint*>(buf(STRATA_BUF_WAVE_N)),
       static_cast<atomic_uint*>(buf(STRATA_BUF_STATUS)),
       static_cast<const uchar*>(buf(STRATA_BUF_ARENA0 + 0)),
       static_cast<const uchar*>(buf(STRATA_BUF_ARENA0 + 1)),
       static_cast<const uchar*>(buf(STRATA_BUF_ARENA0 + 2)),
       static_cast<const uchar*>(buf(STRATA_BUF_ARENA0 + 3)),
       static_cast<const uchar*>(buf(STRATA_BUF_ARENA0 + 4)),
       static_cast<const uchar*>(buf(STRATA_BUF_ARENA0 + 5)),
       static_cast<const uchar*>(buf(STRATA_BUF_ARENA0 + 6)),
       static_cast<const uchar*>(buf(STRATA_BUF_ARENA0 + 7)), s.tg, tpos, linear % 32,
       linear / 32);
  s.fibers[linear].done = true;
  s.progress = true;
  // Returning ends the fiber: uc_link resumes the scheduler.
}

// Runs one threadgroup to completion. A full round in which no fiber moved means some lanes
// wait at a simd_sum or barrier that others will never reach: on a GPU undefined behaviour,
// here a named failure.
void run_group(Scheduler& s, uint3 tg) {
  s.tg = tg;
  const unsigned n = unsigned(s.fibers.size());
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = s.fibers[i];
    f.done = false;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.get();
    f.ctx.uc_stack.ss_size = kFiberStack;
    f.ctx.uc_link = &s.main;
    makecontext(&f.ctx, fiber_main, 0);
  }
  for (auto& g : s.simd) g.sync.count = 0;
  s.group.count = 0;
  unsigned live = n;
  while (live > 0) {
    s.progress = false;
    live = 0;
    for (unsigned i = 0; i < n; ++i) {
      if (s.fibers[i].done) continue;
      s.current = i;
      swapcontext(&s.main, &s.fibers[i].ctx);
      live += s.fibers[i].done ? 0 : 1;
    }
    if (live > 0 && !s.progress) {
      std::fprintf(stderr,
                   "msl shim: threadgroup (%u, %u, %u) deadlocked: a simd_sum or "
                   "threadgroup_barrier is not reached by every thread (divergent control flow)\n",
                   tg.x, tg.y, tg.z);
      std::abort();
    }
  }
}

std::map<std::string, KernelFn>& registry() {
  static std::map<std::string, KernelFn> r;
  return r;
}

}  // namespace

bool register_kernel(const char* name, KernelFn fn) {
  auto [it, fresh] = registry().emplace(name, fn);
  if (!fresh && it->second != fn) {
    std::fprintf(stderr, "msl shim: kernel %s registered twice\n", name);
    std::abort();
  }
  return true;
}

KernelFn find_kernel(const std::string& name) {
  auto it = registry().find(name);
  return it == registry().end() ? nullptr : it->second;
}

std::vector<std::string> kernel_names() {
  std::vector<std::string> names;
  for (const auto& [name, fn] : registry()) names.push_back(name);
  return names;
}

void dispatch(KernelFn fn, const KernelParams& p, const Bindings& b, const std::uint32_t groups[3],
              const std::uint32_t threads[3]) {
  const unsigned n = threads[0] * threads[1] * threads[2];
  const std::uint64_t total = std::uint64_t(groups[0]) * groups[1] * groups[2];
  std::atomic<std::uint64_t> next{0};
  auto worker = [&] {
    Scheduler s;
    s.fn = fn;
    s.p = &p;
    s.b = &b;
    s.threads = threads;
    s.fibers.resize(n);
    for (auto& f : s.fibers) f.stack = std::make_unique_for_overwrite<char[]>(kFiberStack);  // untouched pages stay free
    s.simd.resize((n + 31) / 32);
    for (unsigned g = 0; g < s.simd.size(); ++g) {
      s.simd[g].lanes = std::min(32u, n - g * 32);
      s.simd[g].sync.n = s.simd[g].lanes;
    }
    s.group.n = n;
    tl_sched = &s;
    for (std::uint64_t i; (i = next.fetch_add(1)) < total;) {
      const uint3 tg{std::uint32_t(i % groups[0]), std::uint32_t(i / groups[0] % groups[1]),
                     std::uint32_t(i / (std::uint64_t(groups[0]) * groups[1]))};
      run_group(s, tg);
    }
    tl_sched = nullptr;
  };
  std::thread second(worker);
  worker();
  second.join();
}

}  // namespace strata_shim

namespace metal_shim {

// Every lane publishes its value, then each sums all of them in the same fixed tree (pairs at
// distance 16, 8, 4, 2, 1, as a butterfly reduction does), so every lane returns the same bits.
float simd_sum(float v) {
  using namespace strata_shim;
  Scheduler& s = *tl_sched;
  SimdGroup& g = s.simd[s.current / 32];
  g.slot[s.current % 32] = v;
  arrive_and_wait(g.sync);
  float part[32];
  for (unsigned i = 0; i < 32; ++i) part[i] = i < g.lanes ? g.slot[i] : 0.0f;
  for (unsigned d = 16; d >= 1; d /= 2)
    for (unsigned i = 0; i < d; ++i) part[i] = part[i] + part[i + d];
  arrive_and_wait(g.sync);  // nobody overwrites a slot before every lane has read them all
  return part[0];
}

void threadgroup_barrier(mem_flags) { strata_shim::arrive_and_wait(strata_shim::tl_sched->group); }

}  // namespace metal_shim
