// The hook at IO completion (residency/record_observer.h): an observer sees every record's
// complete bytes before the record can be published (I1 for a backend's device copy), a
// throwing observer is that record's read error, and observers come and go under concurrent IO
// (remove_observer returns only once no IO thread is inside the removed one). Run under TSan in
// CI, where the IO threads, the observers and the registering thread meet.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "exec/window.h"
#include "residency/record_observer.h"
#include "residency/stream_testing.h"
#include "delegating_backend.h"
#include "stream_test_util.h"

using namespace strata;
using namespace strata::test;

namespace {

// Checks what it is shown against the file and against smap (a lock-free read: the one thing
// of the stream an observer may look at here, to see that nothing is published yet). Its
// counters are atomics: IO threads call it concurrently, the test thread reads them.
class CheckingObserver final : public RecordObserver {
 public:
  CheckingObserver(const ExpertStream& s, const TestGeometry& g) : s_(s), g_(g) {}
  void on_record_complete(const CompletedRecord& r) override {
    calls.fetch_add(1);
    if (gone.load()) called_after_removal.fetch_add(1);
    const std::uint32_t layer = r.key / g_.n_experts, expert = r.key % g_.n_experts;
    const auto want = expected_record(g_, layer, expert);
    if (r.size != s_.layout().record_bytes || r.bytes != s_.arena().slot(r.slot) ||
        std::memcmp(r.bytes, want.data(), want.size()) != 0)
      wrong_bytes.fetch_add(1);
    if (s_.smap_at(r.key) != kAbsent) published_early.fetch_add(1);
    std::unique_lock<std::mutex> lk(mu_);
    seen_.push_back(r.key);
    if (r.key == hold_key) {  // the test looks at the stream while this call is in progress
      inside = true;
      cv_.notify_all();
      cv_.wait(lk, [&] { return !holding; });
    }
    if (r.key == fail_key && fail_left > 0) {
      --fail_left;
      throw std::runtime_error("fake device copy failed (cudaErrorFake)");
    }
  }
  std::vector<std::uint32_t> seen() {
    std::lock_guard<std::mutex> lk(mu_);
    return seen_;
  }
  void hold(std::uint32_t key) {
    std::lock_guard<std::mutex> lk(mu_);
    hold_key = key;
    holding = true;
  }
  void wait_inside() {
    std::unique_lock<std::mutex> lk(mu_);
    REQUIRE(cv_.wait_for(lk, std::chrono::seconds(30), [&] { return inside; }));
  }
  void let_go() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      holding = false;
    }
    cv_.notify_all();
  }
  void fail(std::uint32_t key, int times) {
    std::lock_guard<std::mutex> lk(mu_);
    fail_key = key;
    fail_left = times;
  }

  std::atomic<int> calls{0}, wrong_bytes{0}, published_early{0}, called_after_removal{0};
  std::atomic<bool> gone{false};  // set once remove_observer returned

 private:
  const ExpertStream& s_;
  TestGeometry g_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::uint32_t> seen_;  // mu_
  std::uint32_t hold_key = kNoKey, fail_key = kNoKey;  // mu_
  bool holding = false, inside = false;                 // mu_
  int fail_left = 0;                                    // mu_
};

std::size_t count(const std::vector<std::uint32_t>& v, std::uint32_t key) {
  std::size_t n = 0;
  for (std::uint32_t k : v) n += k == key;
  return n;
}

}  // namespace

TEST_CASE("record observers see complete bytes once a record, before publication (I1)") {
  TestGeometry g;
  auto path = build_test_pack(g, "observer_bytes");
  PackLayout L = read_pack_layout(path);
  ExpertStream s(path, small_options(8, L, 3));
  REQUIRE(s.n_parts() == 3);  // several parts a record: the observer sees the whole record
  CheckingObserver obs(s, g);
  const ObserverId id = s.add_observer(&obs);
  CHECK(s.n_observers() == 1);

  std::int32_t urgent[] = {1, 5, 7};
  s.request(2, urgent, 3, ReadClass::Urgent);
  s.wait(2, urgent, 3);
  std::int32_t predicted[] = {3, 4};
  s.enter_layer(0);
  s.request(1, predicted, 2, ReadClass::Pred1);
  s.settle();
  CHECK(s.smap_at(1 * g.n_experts + 3) == kAbsent);  // speculative: published at the handshake
  CHECK(s.publish(0) == 2);

  const auto seen = obs.seen();
  CHECK(seen.size() == 5);
  for (std::int32_t e : urgent) CHECK(count(seen, 2 * g.n_experts + std::uint32_t(e)) == 1);
  for (std::int32_t e : predicted) CHECK(count(seen, 1 * g.n_experts + std::uint32_t(e)) == 1);
  CHECK(obs.wrong_bytes.load() == 0);
  CHECK(obs.published_early.load() == 0);
  for (std::int32_t e : urgent) CHECK(slot_matches(s, g, 2, std::uint32_t(e)));
  CHECK(StreamTesting::check_invariants(s).empty());
  s.remove_observer(id);
  CHECK(s.n_observers() == 0);
  std::remove(path.c_str());
}

TEST_CASE("nothing is published while an observer is inside the record's completion") {
  TestGeometry g;
  auto path = build_test_pack(g, "observer_hold");
  PackLayout L = read_pack_layout(path);
  ExpertStream s(path, small_options(8, L, 2));
  CheckingObserver obs(s, g);
  const ObserverId id = s.add_observer(&obs);
  const std::uint32_t key = 2 * g.n_experts + 6;
  obs.hold(key);
  std::int32_t ex[] = {6};
  s.request(2, ex, 1, ReadClass::Urgent);
  obs.wait_inside();
  // Every part is read, yet the record is neither complete nor published, and its slot cannot
  // be recycled: the last part still counts as in flight.
  const SlotInfo held = s.slots()[std::size_t(s.where(2, 6))];
  CHECK(held.state == SlotState::Reading);
  CHECK(held.parts_started == held.parts_total);
  CHECK(held.parts_done + 1 == held.parts_total);
  CHECK(s.smap_at(key) == kAbsent);
  CHECK(!s.describe_in_flight().empty());
  // remove_observer waits for the call in progress.
  std::atomic<bool> removed{false};
  std::thread remover([&] {
    s.remove_observer(id);
    removed.store(true);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  CHECK(!removed.load());  // still inside: remove_observer must not have returned
  obs.let_go();
  remover.join();
  s.wait(2, ex, 1);
  CHECK(s.smap_at(key) != kAbsent);
  CHECK(slot_matches(s, g, 2, 6));
  std::remove(path.c_str());
}

TEST_CASE("a throwing observer is the read error, naming its cause; the stream stays usable") {
  TestGeometry g;
  auto path = build_test_pack(g, "observer_throw");
  PackLayout L = read_pack_layout(path);
  ExpertStream s(path, small_options(8, L, 2));
  CheckingObserver obs(s, g);
  const ObserverId id = s.add_observer(&obs);
  const std::uint32_t key = 3 * g.n_experts + 2;
  obs.fail(key, 1);
  std::int32_t ex[] = {2};
  try {
    s.wait(3, ex, 1);
    FAIL("expected an ExpertReadError");
  } catch (const ExpertReadError& e) {
    CHECK(e.layer == 3);
    CHECK(e.expert == 2);
    CHECK(e.err == 0);
    CHECK(e.offset == L.record_offset(key));
    const std::string what = e.what();
    CHECK(what.find("layer 3 expert 2") != std::string::npos);
    CHECK(what.find("fake device copy failed (cudaErrorFake)") != std::string::npos);
  }
  CHECK(s.where(3, 2) < 0);  // not published, recycled
  CHECK(s.stats().failed.load() == 1);
  s.wait(3, ex, 1);  // the observer failed once: a retry reads, observes and publishes
  CHECK(slot_matches(s, g, 3, 2));

  // A speculative record the observer refuses is dropped and counted, never published.
  const std::uint32_t spec = 1 * g.n_experts + 9;
  obs.fail(spec, 1);
  std::int32_t p[] = {9};
  s.enter_layer(0);
  s.request(1, p, 1, ReadClass::Pred1);
  s.settle();
  CHECK(s.stats().spec_failed.load() == 1);
  CHECK(s.publish(0) == 0);
  CHECK(s.where(1, 9) < 0);
  CHECK(StreamTesting::check_invariants(s).empty());
  s.remove_observer(id);
  std::remove(path.c_str());
}

namespace {

// Records every part it is shown and checks it against the file; at the record's completion,
// that this read's parts (one generation) were all seen, each once, covering the record.
class PartObserver final : public RecordObserver {
 public:
  PartObserver(const ExpertStream& s, const TestGeometry& g) : s_(s), g_(g) {}
  void on_part_read(const ReadPart& p) override {
    const auto want = expected_record(g_, p.key / g_.n_experts, p.key % g_.n_experts);
    if (p.bytes != s_.arena().slot(p.slot) + p.offset || p.offset + p.size > want.size() ||
        std::memcmp(p.bytes, want.data() + p.offset, p.size) != 0)
      wrong_bytes.fetch_add(1);
    if (s_.smap_at(p.key) != kAbsent) published_early.fetch_add(1);
    // The split it is told: part k at k * part_bytes, `parts` of them covering the record.
    if (p.part_bytes != s_.part_bytes() || p.offset != std::uint64_t(p.part) * p.part_bytes ||
        p.part >= p.parts || std::uint64_t(p.parts - 1) * p.part_bytes >= want.size() ||
        std::uint64_t(p.parts) * p.part_bytes < want.size())
      wrong_split.fetch_add(1);
    std::lock_guard<std::mutex> lk(mu_);
    if (p.key == fail_key) throw std::runtime_error("fake part copy failed (cudaErrorFake)");
    parts_[p.slot].push_back(p);
  }
  void on_record_complete(const CompletedRecord& r) override {
    std::lock_guard<std::mutex> lk(mu_);
    std::vector<ReadPart>& mine = parts_[r.slot];
    std::vector<int> seen(r.parts, 0);
    std::uint64_t bytes = 0;
    for (const ReadPart& p : mine) {
      if (p.gen != r.gen || p.key != r.key || p.part >= r.parts || p.parts != r.parts) {
        ++stray;
        continue;
      }
      ++seen[p.part];
      bytes += p.size;
    }
    bool whole = bytes == r.size;
    for (int n : seen) whole = whole && n == 1;
    records += 1;
    complete_records += whole;
    mine.clear();
  }
  void fail(std::uint32_t key) {
    std::lock_guard<std::mutex> lk(mu_);
    fail_key = key;
  }
  std::atomic<int> wrong_bytes{0}, published_early{0}, wrong_split{0};
  int records = 0, complete_records = 0, stray = 0;  // mu_ (read once IO settled)

 private:
  const ExpertStream& s_;
  TestGeometry g_;
  std::mutex mu_;
  std::map<std::uint32_t, std::vector<ReadPart>> parts_;  // mu_: by slot, this read's so far
  std::uint32_t fail_key = kNoKey;                        // mu_
};

}  // namespace

TEST_CASE("an observer sees each part of a record as it lands, then the record, one generation") {
  TestGeometry g;
  auto path = build_test_pack(g, "observer_parts");
  PackLayout L = read_pack_layout(path);
  // Fewer slots than records: slots are recycled, so a slot's next read is another generation.
  ExpertStream s(path, small_options(8, L, 3));
  REQUIRE(s.n_parts() == 3);
  PartObserver obs(s, g);
  const ObserverId id = s.add_observer(&obs);
  int records = 0;
  for (std::uint32_t layer = 0; layer < 3; ++layer) {
    std::int32_t ex[] = {1, 4, 6, 9};
    s.wait(layer, ex, 4);
    records += 4;
    for (std::int32_t e : ex) CHECK(slot_matches(s, g, layer, std::uint32_t(e)));
  }
  s.settle();
  CHECK(obs.records == records);
  CHECK(obs.complete_records == records);
  CHECK(obs.stray == 0);
  CHECK(obs.wrong_bytes.load() == 0);
  CHECK(obs.wrong_split.load() == 0);
  CHECK(obs.published_early.load() == 0);

  // A part the observer refuses fails the record with its cause; the stream stays usable.
  obs.fail(3 * g.n_experts + 2);
  std::int32_t bad[] = {2};
  try {
    s.wait(3, bad, 1);
    FAIL("expected an ExpertReadError");
  } catch (const ExpertReadError& e) {
    CHECK(e.layer == 3);
    CHECK(e.expert == 2);
    CHECK(std::string(e.what()).find("fake part copy failed (cudaErrorFake)") != std::string::npos);
  }
  CHECK(s.where(3, 2) < 0);
  obs.fail(kNoKey);
  s.wait(3, bad, 1);
  CHECK(slot_matches(s, g, 3, 2));
  CHECK(StreamTesting::check_invariants(s).empty());
  s.remove_observer(id);
  std::remove(path.c_str());
}

TEST_CASE("observers come and go under concurrent IO; none is called once removed") {
  TestGeometry g;
  auto path = build_test_pack(g, "observer_churn");
  PackLayout L = read_pack_layout(path);
  ExpertStream s(path, small_options(8, L, 4));  // 8 slots of 64 keys: constant recycling
  std::atomic<bool> done{false};
  std::vector<std::unique_ptr<CheckingObserver>> observers;  // kept: a late call is counted
  std::thread churn([&] {
    // Up to three observers at once, registered and removed in an interleaved order.
    std::vector<std::pair<ObserverId, CheckingObserver*>> live;
    std::mt19937 rng(7);
    for (int i = 0; i < 300 || !done.load(); ++i) {
      if (live.size() < 3 && (live.empty() || rng() % 2)) {
        observers.push_back(std::make_unique<CheckingObserver>(s, g));
        live.emplace_back(s.add_observer(observers.back().get()), observers.back().get());
      } else {
        const std::size_t j = rng() % live.size();
        s.remove_observer(live[j].first);
        live[j].second->gone.store(true);
        live.erase(live.begin() + std::ptrdiff_t(j));
      }
      if (i > 100000) break;  // bounded whatever happens
      std::this_thread::yield();
    }
    for (auto& [id, o] : live) {
      s.remove_observer(id);
      o->gone.store(true);
    }
  });
  std::mt19937 rng(11);
  for (int round = 0; round < 200; ++round) {
    const std::uint32_t layer = rng() % g.n_layers;
    std::int32_t ex[] = {std::int32_t(rng() % g.n_experts), std::int32_t(rng() % g.n_experts)};
    if (ex[0] == ex[1]) ex[1] = (ex[1] + 1) % std::int32_t(g.n_experts);
    s.wait(layer, ex, 2);
    for (std::int32_t e : ex) REQUIRE(slot_matches(s, g, layer, std::uint32_t(e)));
  }
  done.store(true);
  churn.join();
  CHECK(s.n_observers() == 0);
  int calls = 0;
  for (const auto& o : observers) {
    calls += o->calls.load();
    CHECK(o->called_after_removal.load() == 0);
    CHECK(o->wrong_bytes.load() == 0);
    CHECK(o->published_early.load() == 0);
  }
  CHECK(calls > 0);
  CHECK(StreamTesting::check_invariants(s).empty());
  std::remove(path.c_str());
}

namespace {

// The CPU backend with a record observer: how a Window registers a backend's observer at
// construction and removes it at close.
class ObservedBackend final : public DelegatingBackend {
 public:
  explicit ObservedBackend(RecordObserver* observer) : observer_(observer) {}
  std::string name() const override { return "observed-cpu"; }
  RecordObserver* record_observer() override { return observer_; }

 private:
  RecordObserver* observer_;
};

}  // namespace

TEST_CASE("a Window registers its backend's record observer and removes it when it closes") {
  TestGeometry g;
  auto path = build_test_pack(g, "observer_window");
  PackLayout L = read_pack_layout(path);
  ExpertStream s(path, small_options(16, L, 3));
  CheckingObserver obs(s, g);
  {
    Window w(s, std::make_unique<ObservedBackend>(&obs), WindowOptions{});
    CHECK(s.n_observers() == 1);
    std::mt19937 rng(3);
    std::normal_distribution<float> nd;
    std::vector<float> x(L.hidden), out(L.hidden);
    for (auto& v : x) v = nd(rng);
    w.begin_turn();
    for (std::uint32_t l = 0; l < L.n_layers; ++l) w.moe(l, x.data(), 1, out.data());
    w.end_turn();
    CHECK(obs.calls.load() > 0);
    CHECK(obs.wrong_bytes.load() == 0);
    CHECK(obs.published_early.load() == 0);
    w.close();
    CHECK(s.n_observers() == 0);
  }
  CHECK(s.n_observers() == 0);
  std::remove(path.c_str());
}

namespace {

// What a backend's device copy costs a miss, as a sleep in the record's observer call.
class SleepingObserver final : public RecordObserver {
 public:
  explicit SleepingObserver(int ms) : ms_(ms) {}
  void on_record_complete(const CompletedRecord&) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms_));
  }

 private:
  int ms_;
};

}  // namespace

// The miss phases (stats.h) put a miss's time where it was spent: a stall before every part's
// pread is the reads' phase, an observer's sleep the finish phase, and the phases are disjoint
// spans of the wait. Only reads urgent from their start count: a hit, a speculative read and
// one promoted to urgent add nothing. The bounds are the injected sleeps and the wait's own
// span, so none depends on how fast the machine is.
TEST_CASE("a miss's phases say where its time went: the reads, the observers, the rest") {
  TestGeometry g;
  auto path = build_test_pack(g, "miss_phases");
  PackLayout L = read_pack_layout(path);
  ExpertStream s(path, small_options(8, L, 3));
  REQUIRE(s.n_parts() == 3);
  SleepingObserver obs(30);
  const ObserverId id = s.add_observer(&obs);
  slow_down(s, L, 2, {5}, 20);

  std::int32_t miss[] = {5};
  const auto t0 = Clock::now();
  s.request(2, miss, 1, ReadClass::Urgent);
  s.wait(2, miss, 1);
  const double waited = double(ns_since(t0)) * 1e-9;
  auto st = s.stats().snapshot();
  CHECK(st.at("miss_timed") == 1);
  CHECK(st.at("miss_read_seconds") >= 0.020);
  CHECK(st.at("miss_finish_seconds") >= 0.030);
  CHECK(st.at("miss_queued_seconds") + st.at("miss_read_seconds") +
            st.at("miss_finish_seconds") + st.at("miss_publish_seconds") <=
        waited);

  s.wait(2, miss, 1);  // a hit
  std::int32_t predicted[] = {3};
  s.enter_layer(0);
  s.request(1, predicted, 1, ReadClass::Pred1);  // speculative, published at the handshake
  s.settle();
  CHECK(s.publish(0) == 1);
  slow_down(s, L, 1, {4}, 20);
  std::int32_t promoted[] = {4};
  s.request(1, promoted, 1, ReadClass::Pred1);
  s.request(1, promoted, 1, ReadClass::Urgent);  // taken over by an urgent request mid-read
  s.wait(1, promoted, 1);
  st = s.stats().snapshot();
  CHECK(st.at("miss_timed") == 1);
  s.remove_observer(id);
  CHECK(StreamTesting::check_invariants(s).empty());
}
