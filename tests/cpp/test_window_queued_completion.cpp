// A routed call on device memory that returns with its kernels queued (Window::moe_routed_device
// with the caller's stream, Backend::completes_async): the Window's pending completion, I4 while
// it is pending, and the paths that end it (the next call, begin_turn, end_turn, close, a device
// error found only at the drain).
//
// The backend here runs its kernels late, as a GPU behind a returned call would: a device thread
// takes the commands in order, but the expert passes only note what they will read (each entry's
// slot, taken as the cuda backend takes its plan) and read it when the backend drains (a Signal
// that is not queued, or synchronize()). A queued Signal is raised at once with its kernels still
// "on the GPU". Each late read compares the slot's bytes with the record of the key it was
// planned for, and the output is a function of the bytes read, so a slot recycled under a queued
// kernel shows both as a stale read and as output that differs from the all-resident run's.
#include <catch2/catch.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "common/errors.h"
#include "exec/queued_backend.h"
#include "exec/window.h"
#include "residency/smap.h"
#include "residency/stream_testing.h"
#include "stream_test_util.h"

using namespace strata;
using namespace strata::test;

namespace {

// The device queue is the engine's own (exec/queued_backend.h); the passes' late reads are this
// test's, under its own lock mu_ (taken inside the queue's lock at a drain, never around it).
class LateKernelBackend final : public QueuedBackend<> {
 public:
  explicit LateKernelBackend(const TestGeometry& g) : QueuedBackend("late-kernels"), g_(g) {
    start();
  }
  ~LateKernelBackend() override { stop(); }
  std::string name() const override { return "late-kernels"; }
  std::optional<std::string> unsupported(const Capability& c) const override {
    Capability host = c;
    host.io = Io::Host;
    return Backend::unsupported(host);
  }
  bool completes_async() const override { return true; }
  void set_device_io(const DeviceIo& io) override { store_device_io(io); }

  // What the tests read.
  std::uint64_t stale_reads() const {
    std::lock_guard<std::mutex> lk(mu_);
    return stale_;
  }
  std::uint64_t queued_signals() const {
    std::lock_guard<std::mutex> lk(mu_);
    return queued_signals_;
  }
  std::size_t late_kernels() const {
    std::lock_guard<std::mutex> lk(mu_);
    return late_.size();
  }
  // The most chunks' kernels that were queued at once (run together at one drain).
  std::size_t most_late_kernels() const {
    std::lock_guard<std::mutex> lk(mu_);
    return most_late_;
  }
  void fail_next_drain() {
    std::lock_guard<std::mutex> lk(mu_);
    fail_next_drain_ = true;
  }

 private:
  struct Read {
    std::uint32_t entry, slot, key;
    bool done = false;  // read already (its kernel finished at a drain before the chunk's end)
    double digest = 0;  // a function of the bytes read
  };
  struct Kernel {
    std::vector<Read> reads;
    std::vector<float> w;  // the entries' weights, as they were at the pass
    std::uint32_t rows = 0;
    const float* x = nullptr;
    float* out = nullptr;
  };

  std::uint32_t key(std::uint32_t layer, std::int32_t e) const {
    return layer * g_.n_experts + std::uint32_t(e);
  }

  // The queue's hooks. The device is idle at bind and at a drain.
  void bind_idle(const DeviceBuffers& b) override {
    std::lock_guard<std::mutex> lk(mu_);
    b_ = b;
  }
  std::string drained() override {
    std::lock_guard<std::mutex> lk(mu_);
    run_late_locked();
    if (!fail_next_drain_) return "";
    fail_next_drain_ = false;
    return "device: a planted fault found at the drain";
  }
  void skipped(const QueuedCommand&) override {
    std::lock_guard<std::mutex> lk(mu_);
    chunk_ = {};
  }
  std::string execute(const QueuedCommand& it) override {
    if (it.c.op == Op::Wait) {
      it.c.event->wait(it.c.value);  // abort_pending() raises it
      return "";
    }
    std::unique_lock<std::mutex> lk(mu_);
    execute_locked(it, lk);
    return "";
  }

  void execute_locked(const QueuedCommand& it, std::unique_lock<std::mutex>& lk) {
    const Command& c = it.c;
    const std::size_t n = std::size_t(c.rows) * g_.top_k;
    switch (c.op) {
      case Op::Plan:
        plan_.resize(n);
        for (std::size_t i = 0; i < n; ++i) plan_[i] = smap_load(b_.smap, key(c.layer, b_.ids[i]));
        return;
      case Op::GateUp:  // note the pass's reads; Down reads nothing more
        for (std::size_t i = 0; i < n && i < plan_.size(); ++i) {
          const bool resident = plan_[i] != kAbsent;
          if (resident != (c.pass == Pass::Resident)) continue;
          const std::uint32_t k = key(c.layer, b_.ids[i]);
          const std::uint32_t slot = resident ? plan_[i] : smap_load(b_.smap, k);
          chunk_.reads.push_back({std::uint32_t(i), slot, k, false, 0});
        }
        return;
      case Op::MoeMM:
        for (std::size_t i = 0; i < n; ++i) {
          const bool in_wave =
              std::find(b_.wave, b_.wave + *b_.wave_n, b_.ids[i]) != b_.wave + *b_.wave_n;
          const std::uint32_t k = key(c.layer, b_.ids[i]);
          if (in_wave) chunk_.reads.push_back({std::uint32_t(i), smap_load(b_.smap, k), k, false, 0});
        }
        return;
      case Op::Combine:
        chunk_.rows = c.rows;
        chunk_.w.assign(b_.weights, b_.weights + n);
        chunk_.x = it.io.x;
        chunk_.out = it.io.out;
        late_.push_back(std::move(chunk_));
        chunk_ = {};
        return;
      case Op::Signal:
        if (c.queued && it.io.ordered) {
          ++queued_signals_;  // raised with the kernels still queued
        } else {
          run_late_locked();
        }
        lk.unlock();
        c.event->signal(c.value);
        lk.lock();
        return;
      default:
        return;
    }
  }

  // A noted read happens: its slot's bytes now against its key's record. mu_ held.
  void read_locked(Read& r) {
    if (r.done) return;
    r.done = true;
    const std::uint32_t layer = r.key / g_.n_experts, expert = r.key % g_.n_experts;
    const auto want = expected_record(g_, layer, expert);
    const unsigned char* got = b_.arena + std::size_t(r.slot) * b_.slot_bytes;
    if (r.slot >= b_.n_slots || std::memcmp(got, want.data(), want.size()) != 0) ++stale_;
    // FNV-1a over the bytes read: the output depends on every one of them.
    std::uint64_t h = 1469598103934665603ull;
    for (std::size_t i = 0; r.slot < b_.n_slots && i < want.size(); ++i)
      h = (h ^ got[i]) * 1099511628211ull;
    r.digest = double(h >> 40) / double(1u << 24);
  }

  // The queued kernels run: each reads its slots now, and so do the passes of the chunk being
  // noted (a wave's kernels finish at a Signal that is not queued, before the chunk's end).
  // mu_ held.
  void run_late_locked() {
    const std::size_t H = g_.hidden;
    most_late_ = std::max(most_late_, late_.size());
    for (Read& r : chunk_.reads) read_locked(r);
    for (Kernel& kern : late_) {
      if (!kern.out || !kern.x) continue;  // the tests make routed calls on "device" rows only
      std::vector<double> digest(kern.w.size(), 0.0);
      for (Read& r : kern.reads) {
        read_locked(r);
        digest[r.entry] = r.digest;
      }
      for (std::uint32_t t = 0; t < kern.rows; ++t)
        for (std::size_t c = 0; c < H; ++c) {
          float acc = 0.0f;
          for (std::uint32_t j = 0; j < g_.top_k; ++j) {
            const std::size_t e = std::size_t(t) * g_.top_k + j;
            acc += kern.w[e] * float(digest[e]) * kern.x[t * H + c];
          }
          kern.out[t * H + c] = acc;
        }
    }
    late_.clear();
  }

  const TestGeometry g_;
  mutable std::mutex mu_;
  bool fail_next_drain_ = false;  // mu_
  DeviceBuffers b_;             // mu_ (bind)
  std::vector<std::uint32_t> plan_;  // the device thread's
  Kernel chunk_;                     // mu_: the chunk being noted
  std::vector<Kernel> late_;         // mu_: queued kernels, run at the next drain
  std::uint64_t stale_ = 0, queued_signals_ = 0;  // mu_
  std::size_t most_late_ = 0;                      // mu_
};

TestGeometry geometry() {
  TestGeometry g;
  g.n_layers = 4;
  g.n_experts = 16;
  g.top_k = 2;
  return g;
}

struct Token {
  std::vector<float> x, w;
  std::vector<std::int32_t> ids;
};

// Token n at layer l: its own x and two experts that change from layer to layer, so that in an
// arena of two layers' top-k every layer's urgent reads must recycle the layer before's slots.
Token token(const TestGeometry& g, std::uint32_t n, std::uint32_t l) {
  Token t;
  t.x.resize(g.hidden);
  for (std::uint32_t c = 0; c < g.hidden; ++c) t.x[c] = float((n * 7 + l * 3 + c) % 11) - 5.0f;
  const std::int32_t a = std::int32_t((n * 5 + l * 3) % g.n_experts);
  t.ids = {a, std::int32_t((std::uint32_t(a) + 1 + l) % g.n_experts)};
  t.w = {0.75f, 0.25f};
  return t;
}

Window::Routed routed_of(const Token& t) {
  Window::Routed r;
  r.ids = t.ids.data();
  r.weights = t.w.data();
  return r;
}

WindowOptions options(bool split) {
  WindowOptions wo;
  wo.lookahead = false;
  wo.profile_prefetch = false;
  wo.split_turn = split;
  return wo;
}

constexpr std::uintptr_t kStream = 0;  // the legacy default stream's handle: any value orders

// Runs `tokens` tokens through every layer, the caller's stream given or not, each output read
// once the Window retired it (the next call, or end_turn after the last).
std::vector<float> run(ExpertStream& stream, LateKernelBackend*& be, bool split, bool queued,
                       std::uint32_t tokens, std::vector<bool>* pending = nullptr,
                       std::vector<bool>* in_turn = nullptr) {
  const TestGeometry g = geometry();
  auto owned = std::make_unique<LateKernelBackend>(g);
  be = owned.get();
  Window w(stream, std::move(owned), options(split));
  std::vector<Token> calls;
  for (std::uint32_t n = 0; n < tokens; ++n)
    for (std::uint32_t l = 0; l < g.n_layers; ++l) calls.push_back(token(g, n, l));
  std::vector<float> out(calls.size() * g.hidden, -1.0f);
  for (std::size_t i = 0; i < calls.size(); ++i) {
    const std::uint32_t l = std::uint32_t(i % g.n_layers);
    w.moe_routed_device(l, calls[i].x.data(), 1, routed_of(calls[i]), out.data() + i * g.hidden,
                        {}, queued ? std::optional<std::uintptr_t>(kStream) : std::nullopt);
    if (pending) pending->push_back(w.completion_pending());
    if (in_turn) in_turn->push_back(w.in_turn());
  }
  w.end_turn();  // retires the last call's kernels
  CHECK_FALSE(w.completion_pending());
  REQUIRE(StreamTesting::check_invariants(stream).empty());
  CHECK(be->stale_reads() == 0);
  if (queued) CHECK(be->queued_signals() == calls.size());
  else CHECK(be->queued_signals() == 0);
  return out;
}

}  // namespace

TEST_CASE("queued completion: a layer's slots outlive its queued kernels, output bitwise") {
  const TestGeometry g = geometry();
  auto path = build_test_pack(g, "queued_completion");
  PackLayout L = read_pack_layout(path);
  LateKernelBackend* be = nullptr;
  std::vector<float> want;
  {
    ExpertStream all(path, small_options(L.n_keys(), L, 2));
    want = run(all, be, false, false, 6);
  }
  for (bool split : {false, true}) {
    for (bool queued : {false, true}) {
      // Two layers' top-k: every layer's urgent reads recycle the previous layer's slots.
      ExpertStream tiny(path, small_options(ExpertStream::min_slots(L), L, 2));
      std::vector<bool> pending, in_turn;
      const auto got = run(tiny, be, split, queued, 6, &pending, &in_turn);
      CHECK(std::memcmp(got.data(), want.data(), got.size() * 4) == 0);
      CHECK(tiny.stats().snapshot().at("evicted") > 0);
      for (std::size_t i = 0; i < pending.size(); ++i) {
        CHECK(pending[i] == queued);  // Done -> LayerPending at each return
        // The implicit turn ends after the last layer, its stream half deferred with it.
        CHECK(in_turn[i] == (i % g.n_layers + 1 != g.n_layers));
      }
    }
  }
}

// One layer-0 call left pending on a minimum arena: the set-up of the eviction cases below.
struct OnePendingLayer {
  explicit OnePendingLayer(const char* name)
      : g(geometry()),
        path(build_test_pack(g, name)),
        L(read_pack_layout(path)),
        stream(path, small_options(ExpertStream::min_slots(L), L, 2)),
        w(stream, make_backend(), options(false)),
        t(token(g, 0, 0)),
        out(g.hidden, -1.0f) {
    w.moe_routed_device(0, t.x.data(), 1, routed_of(t), out.data(), {}, kStream);
  }
  std::unique_ptr<Backend> make_backend() {
    auto owned = std::make_unique<LateKernelBackend>(g);
    be = owned.get();
    return owned;
  }
  const TestGeometry g;
  const std::string path;
  const PackLayout L;
  ExpertStream stream;
  LateKernelBackend* be = nullptr;  // owned by w
  Window w;
  const Token t;
  std::vector<float> out;
};

TEST_CASE("queued completion: another client cannot evict a pending layer's slots") {
  // Every slot but the pending layer's two goes to a rival's reads; the pending ones must stay
  // put while the rival recycles slots.
  OnePendingLayer f("queued_completion_rival");
  ExpertStream& stream = f.stream;
  Window& w = f.w;
  const Token& t = f.t;
  std::vector<float>& out = f.out;
  LateKernelBackend* be = f.be;
  const TestGeometry& g = f.g;
  REQUIRE(w.completion_pending());
  REQUIRE(be->late_kernels() == 1);  // its kernel has not read its slots yet
  // The stream's own client reads experts of layer 2 (neither the pending layer nor the next,
  // which finish_layer protects), twice: the second pair must recycle slots, and may take only
  // the first pair's, never the pending layer's.
  const std::int32_t first[] = {9, 10}, second[] = {11, 12};
  stream.request(2, first, 2, ReadClass::Urgent);
  stream.wait(2, first, 2);
  const auto evicted = stream.stats().snapshot().at("evicted");
  stream.request(2, second, 2, ReadClass::Urgent);
  stream.wait(2, second, 2);
  CHECK(stream.stats().snapshot().at("evicted") > evicted);
  for (std::int32_t e : t.ids) CHECK(slot_matches(stream, g, 0, std::uint32_t(e)));
  w.end_turn();  // the retire: the kernel reads its slots now
  CHECK(be->stale_reads() == 0);
  CHECK(out[0] != -1.0f);
  REQUIRE(StreamTesting::check_invariants(stream).empty());
}

TEST_CASE("queued completion: the check sees a slot recycled under a queued kernel") {
  // The control: what the Window prevents, done by hand. The pending layer's protections are
  // dropped before its kernel ran, a rival recycles its slots, and the late read is stale.
  OnePendingLayer f("queued_completion_control");
  ExpertStream& stream = f.stream;
  Window& w = f.w;
  LateKernelBackend* be = f.be;
  stream.end_turn(w.client());  // what a release before the kernels would do
  const std::int32_t rivals[] = {9, 10, 11, 12};
  stream.request(2, rivals, 4, ReadClass::Urgent);
  stream.wait(2, rivals, 4);
  w.end_turn();
  CHECK(be->stale_reads() > 0);
}

TEST_CASE("queued completion: every path out of a pending layer drains it") {
  const TestGeometry g = geometry();
  auto path = build_test_pack(g, "queued_completion_paths");
  PackLayout L = read_pack_layout(path);
  ExpertStream stream(path, small_options(ExpertStream::min_slots(L), L, 2));
  const Token t0 = token(g, 0, 0), t1 = token(g, 0, 1);
  std::vector<float> out(g.hidden);
  SECTION("begin_turn after a turn that ended pending") {
    auto owned = std::make_unique<LateKernelBackend>(g);
    LateKernelBackend* be = owned.get();
    Window w(stream, std::move(owned), options(false));
    std::vector<Token> ts;  // read by the kernels until they are retired
    for (std::uint32_t l = 0; l < g.n_layers; ++l) ts.push_back(token(g, 1, l));
    for (std::uint32_t l = 0; l < g.n_layers; ++l)
      w.moe_routed_device(l, ts[l].x.data(), 1, routed_of(ts[l]), out.data(), {}, kStream);
    CHECK_FALSE(w.in_turn());
    CHECK(w.completion_pending());  // TurnEndPending: the stream's turn is still open
    w.begin_turn();
    CHECK_FALSE(w.completion_pending());
    CHECK(be->late_kernels() == 0);
    w.end_turn();
  }
  SECTION("close during a pending layer frees its protections and hangs nothing") {
    {
      auto owned = std::make_unique<LateKernelBackend>(g);
      Window w(stream, std::move(owned), options(false));
      w.moe_routed_device(0, t0.x.data(), 1, routed_of(t0), out.data(), {}, kStream);
      REQUIRE(w.completion_pending());
      w.close();
      CHECK_FALSE(w.completion_pending());
    }
    REQUIRE(StreamTesting::check_invariants(stream).empty());
    for (const SlotInfo& s : stream.slots()) CHECK(s.pins == 0);
    // Nothing is protected any more: the stream's own client may take every slot.
    std::vector<std::int32_t> all;
    for (std::uint32_t e = 0; e < ExpertStream::min_slots(L); ++e) all.push_back(std::int32_t(e));
    stream.request(3, all.data(), all.size(), ReadClass::Urgent);
    stream.wait(3, all.data(), all.size());
  }
  SECTION("a device error found at the drain fails the next call; the stream stays usable") {
    auto owned = std::make_unique<LateKernelBackend>(g);
    LateKernelBackend* be = owned.get();
    Window w(stream, std::move(owned), options(false));
    w.moe_routed_device(0, t0.x.data(), 1, routed_of(t0), out.data(), {}, kStream);
    be->fail_next_drain();
    try {  // a device fault is the engine's Device error (strata_stream.errors.DeviceError)
      w.moe_routed_device(1, t1.x.data(), 1, routed_of(t1), out.data(), {}, kStream);
      FAIL("the planted fault was not reported");
    } catch (const strata::EngineError& e) {
      CHECK(e.kind() == strata::ErrorKind::Device);
      CHECK_THAT(e.what(), Catch::Contains("planted fault"));
    }
    CHECK_FALSE(w.completion_pending());
    CHECK_FALSE(w.in_turn());  // the failed call abandoned the turn
    w.moe_routed_device(0, t0.x.data(), 1, routed_of(t0), out.data(), {}, kStream);
    w.end_turn();
    CHECK(be->stale_reads() == 0);
    REQUIRE(StreamTesting::check_invariants(stream).empty());
  }
  SECTION("a device error found at end_turn's drain ends the turn all the same") {
    auto owned = std::make_unique<LateKernelBackend>(g);
    LateKernelBackend* be = owned.get();
    Window w(stream, std::move(owned), options(false));
    w.begin_turn();
    w.moe_routed_device(0, t0.x.data(), 1, routed_of(t0), out.data(), {}, kStream);
    be->fail_next_drain();
    CHECK_THROWS_WITH(w.end_turn(), Catch::Contains("planted fault"));
    CHECK_FALSE(w.in_turn());
    CHECK_FALSE(w.completion_pending());
    REQUIRE(StreamTesting::check_invariants(stream).empty());
    w.moe_routed_device(0, t0.x.data(), 1, routed_of(t0), out.data(), {}, kStream);
    w.end_turn();
  }
  SECTION("a call without the stream waits as before") {
    auto owned = std::make_unique<LateKernelBackend>(g);
    LateKernelBackend* be = owned.get();
    Window w(stream, std::move(owned), options(false));
    w.moe_routed_device(0, t0.x.data(), 1, routed_of(t0), out.data());
    CHECK_FALSE(w.completion_pending());
    CHECK(be->late_kernels() == 0);
    w.end_turn();
  }
}

namespace {

// A call of `rows` tokens at each layer in chunks of max_rows, through every layer in two
// turns, the caller's stream given. Every call's buffers outlive its kernels (until the turn's
// end retires the last of them). No Catch assertion inside (two threads may run it): what went
// wrong is counted in the result, for the caller to check.
struct Chunked {
  std::vector<float> out;
  std::size_t together = 0;  // the most chunks whose kernels ran at one drain
  std::uint64_t stale = 0;   // slots read after they were recycled
  std::string problems;      // a call not pending after it returned, a broken invariant, ...
};

Chunked run_chunked(ExpertStream& stream, bool split, bool decode_path, std::uint32_t rows,
                    std::uint32_t max_rows, std::uint32_t first_token = 0) {
  const TestGeometry g = geometry();
  auto owned = std::make_unique<LateKernelBackend>(g);
  LateKernelBackend* be = owned.get();
  WindowOptions wo = options(split);
  wo.max_rows = max_rows;
  if (!decode_path) wo.decode_rows = wo.decode_batch_rows = 0;  // every chunk in waves
  Window w(stream, std::move(owned), wo);
  const std::uint32_t H = g.hidden;
  struct Call {
    std::vector<float> x, w, out;
    std::vector<std::int32_t> ids;
  };
  Chunked r;
  for (std::uint32_t turn = 0; turn < 2; ++turn) {
    std::vector<Call> calls(g.n_layers);
    w.begin_turn();
    for (std::uint32_t l = 0; l < g.n_layers; ++l) {
      Call& c = calls[l];
      for (std::uint32_t n = 0; n < rows; ++n) {
        const Token t = token(g, first_token + n + turn * rows, l);
        c.x.insert(c.x.end(), t.x.begin(), t.x.end());
        c.ids.insert(c.ids.end(), t.ids.begin(), t.ids.end());
        c.w.insert(c.w.end(), t.w.begin(), t.w.end());
      }
      c.out.assign(std::size_t(rows) * H, -1.0f);
      Window::Routed routed;
      routed.ids = c.ids.data();
      routed.weights = c.w.data();
      w.moe_routed_device(l, c.x.data(), rows, routed, c.out.data(), {}, kStream);
      if (!w.completion_pending()) r.problems += "a queued call returned not pending; ";
      r.problems += StreamTesting::check_invariants(stream);
    }
    w.end_turn();  // retires the last call
    if (w.completion_pending()) r.problems += "end_turn left a completion pending; ";
    for (const Call& c : calls) r.out.insert(r.out.end(), c.out.begin(), c.out.end());
  }
  r.stale = be->stale_reads();
  r.together = be->most_late_kernels();
  return r;
}

}  // namespace

TEST_CASE("queued completion: a long call's chunks stay queued back to back, output bitwise") {
  // Six tokens a call in chunks of two. Every chunk returns queued; the next chunk keeps the
  // queued ones' experts protected when they all fit one wave (the arena of 14 slots: a call's
  // 12 experts and one top-k for prefetches), and drains them first when not (the minimum
  // arena). A later chunk's misses recycle slots in both, so a kept protection that was
  // dropped shows as a stale read and as output unlike the all-resident run's.
  const TestGeometry g = geometry();
  auto path = build_test_pack(g, "queued_completion_chunks");
  PackLayout L = read_pack_layout(path);
  for (bool decode_path : {false, true}) {
    for (bool split : {false, true}) {
      CAPTURE(decode_path, split);
      Chunked want;
      {
        ExpertStream all(path, small_options(L.n_keys(), L, 2));
        want = run_chunked(all, split, decode_path, 6, 6);  // one chunk a call
        CHECK(want.problems.empty());
      }
      {
        ExpertStream fits(path, small_options(14, L, 2));
        const Chunked got = run_chunked(fits, split, decode_path, 6, 2);
        CHECK(got.problems.empty());
        CHECK(got.stale == 0);
        CHECK(std::memcmp(got.out.data(), want.out.data(), got.out.size() * 4) == 0);
        CHECK(fits.stats().snapshot().at("evicted") > 0);
        CHECK(got.together == 3);  // a call's three chunks ran at one drain
      }
      {
        ExpertStream tiny(path, small_options(ExpertStream::min_slots(L), L, 2));
        const Chunked got = run_chunked(tiny, split, decode_path, 6, 2);
        CHECK(got.problems.empty());
        CHECK(got.stale == 0);
        CHECK(std::memcmp(got.out.data(), want.out.data(), got.out.size() * 4) == 0);
        CHECK(got.together == 1);  // each chunk drained before the next
      }
    }
  }
}

TEST_CASE("queued completion: two Windows' queued chunks on one stream, from two threads") {
  // Each Window keeps its own queued chunks' experts; the other's reads may recycle only what
  // neither protects. 28 slots give each Window a wave of 12 (a call's experts: kept), 16 give
  // each 6 (drained before each chunk). Each thread's output is its tokens' alone.
  const TestGeometry g = geometry();
  auto path = build_test_pack(g, "queued_completion_two");
  PackLayout L = read_pack_layout(path);
  Chunked want[2];
  {
    ExpertStream all(path, small_options(L.n_keys(), L, 2));
    for (std::uint32_t i = 0; i < 2; ++i) want[i] = run_chunked(all, false, false, 6, 6, 100 * i);
  }
  for (std::uint32_t slots : {28u, 16u}) {
    CAPTURE(slots);
    ExpertStream stream(path, small_options(slots, L, 2));
    Chunked got[2];
    std::thread other([&] { got[1] = run_chunked(stream, false, false, 6, 2, 100); });
    got[0] = run_chunked(stream, false, false, 6, 2, 0);
    other.join();
    for (std::uint32_t i = 0; i < 2; ++i) {
      CHECK(got[i].problems.empty());
      CHECK(got[i].stale == 0);
      CHECK(std::memcmp(got[i].out.data(), want[i].out.data(), got[i].out.size() * 4) == 0);
      if (slots == 28) CHECK(got[i].together == 3);  // kept whatever the other Window does
    }
    CHECK(stream.stats().snapshot().at("evicted") > 0);
    REQUIRE(StreamTesting::check_invariants(stream).empty());
  }
}

TEST_CASE("queued completion: a host point that keeps the executing layer's protections") {
  // The stream's half of a chunk that stays queued: at_layer with keep_executing adds the new
  // chunk's experts to those its layer already protects. Without it (the control) the earlier
  // chunk's experts lose their protection, and a rival's reads recycle their slots.
  const TestGeometry g = geometry();
  auto path = build_test_pack(g, "queued_completion_keep");
  PackLayout L = read_pack_layout(path);
  for (bool keep : {true, false}) {
    CAPTURE(keep);
    ExpertStream stream(path, small_options(6, L, 2));
    const ClientId me = stream.open_client({});
    const std::int32_t first[] = {1, 2}, second[] = {3};
    HandshakeRequest q;
    q.layer = 0;
    q.urgent = first;
    q.n_urgent = 2;
    stream.at_layer(me, q);
    stream.wait(me, 0, first, 2);
    q.urgent = second;
    q.n_urgent = 1;
    q.keep_executing = keep;
    stream.at_layer(me, q);
    stream.wait(me, 0, second, 1);
    // The rest of the arena, and more: the rival's reads need the unprotected slots.
    const std::int32_t rivals[] = {8, 9, 10, 11, 12};
    for (std::int32_t e : rivals) {
      stream.request(2, &e, 1, ReadClass::Urgent);
      stream.wait(2, &e, 1);
    }
    for (std::int32_t e : first) CHECK(slot_matches(stream, g, 0, std::uint32_t(e)) == keep);
    CHECK(slot_matches(stream, g, 0, 3));
    REQUIRE(StreamTesting::check_invariants(stream).empty());
    stream.close_client(me);
  }
}

TEST_CASE("queued completion: keep is refused at a layer the client is not executing") {
  const TestGeometry g = geometry();
  auto path = build_test_pack(g, "queued_completion_keep_refused");
  PackLayout L = read_pack_layout(path);
  ExpertStream stream(path, small_options(6, L, 2));
  const ClientId me = stream.open_client({});
  const std::int32_t e[] = {1};
  HandshakeRequest q;
  q.layer = 1;
  q.urgent = e;
  q.n_urgent = 1;
  q.keep_executing = true;
  CHECK_THROWS_WITH(stream.at_layer(me, q), Catch::Contains("not executing"));
  stream.close_client(me);
}
