// The IO path: parking a reading slot cancels its parts not yet begun (and revive re-queues
// exactly those), and verify_reads catches a record that changed on disk.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>

#include "common/errors.h"
#include "stream_test_util.h"
#include "residency/stream_testing.h"

using namespace strata;
using namespace strata::test;

namespace {

SlotInfo slot_of(const ExpertStream& s, std::uint32_t key) {
  const std::uint32_t E = s.layout().n_experts;
  std::int32_t at = s.where(key / E, key % E);
  REQUIRE(at >= 0);
  return s.slots()[std::size_t(at)];
}

// Polls a condition the IO threads will make true; fails (not hangs) if they never do.
void eventually(const std::function<bool()>& ready) {
  auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!ready()) {
    REQUIRE(std::chrono::steady_clock::now() < give_up);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

std::size_t jobs_of(const ExpertStream& s, std::uint32_t slot) {
  std::size_t n = 0;
  for (const JobInfo& j : StreamTesting::pending_jobs(s)) n += j.slot == slot;
  return n;
}

}  // namespace

TEST_CASE("parking a reading slot cancels its parts not yet begun; limbo waits for the rest (I7)") {
  TestGeometry g;
  auto path = build_test_pack(g, "park_reading");
  PackLayout L = read_pack_layout(path);
  ExpertStream s(path, small_options(8, L, 1));
  REQUIRE(s.n_parts() == 3);
  const std::uint32_t key = 1 * g.n_experts + 5;
  Fault gate;
  gate.kind = FaultKind::Gate;
  gate.delay_ms = 60000;
  StreamTesting::faults(s).add(key, 0, gate);  // part 0 stays in flight until the test opens the gate

  std::int32_t predicted[] = {5};
  s.request(1, predicted, 1, ReadClass::Pred1);
  eventually([&] { return slot_of(s, key).parts_started == 1; });
  const std::uint32_t slot = slot_of(s, key).slot;
  CHECK(jobs_of(s, slot) == 2);

  std::int32_t chosen[] = {0};
  CHECK(s.retire_unused_pre(1, chosen, 1) == 1);  // the router chose another expert
  SlotInfo parked = slot_of(s, key);
  CHECK(parked.state == SlotState::Limbo);
  CHECK(jobs_of(s, slot) == 0);  // parts 1 and 2 are not read
  CHECK(s.release_limbo() == 0);  // part 0 is still in flight: not recycled (I7)
  CHECK(slot_of(s, key).state == SlotState::Limbo);
  CHECK(StreamTesting::check_invariants(s).empty());

  StreamTesting::faults(s).open_gate();
  eventually([&] { return slot_of(s, key).parts_done == 1; });
  CHECK(s.release_limbo() == 1);
  CHECK(s.where(key / s.layout().n_experts, key % s.layout().n_experts) < 0);
  CHECK(StreamTesting::check_invariants(s).empty());
  s.settle();
  const auto& st = s.stats();
  CHECK(st.spec_parts_started.load() == 1);  // one part begun, of three
  CHECK(st.spec_parts_done.load() == 1);
  CHECK(st.bytes_read.load() == kPage);
  std::remove(path.c_str());
}

TEST_CASE("a slot parked while reading, asked for again, reads exactly its cancelled parts") {
  TestGeometry g;
  auto path = build_test_pack(g, "park_revive");
  PackLayout L = read_pack_layout(path);
  ExpertStream s(path, small_options(8, L, 0));  // manual IO: the test runs each part
  const std::uint32_t key = 2 * g.n_experts + 7;
  std::int32_t predicted[] = {7};
  s.request(2, predicted, 1, ReadClass::Pred2);
  REQUIRE(StreamTesting::pending_jobs(s).size() == 3);
  REQUIRE(StreamTesting::run_job(s, 1));  // part 1 first: the cancelled ones need not be a suffix
  std::int32_t chosen[] = {3};
  CHECK(s.retire_unused_pre(2, chosen, 1) == 1);
  CHECK(StreamTesting::pending_jobs(s).empty());
  CHECK(slot_of(s, key).state == SlotState::Limbo);

  s.wait(2, predicted, 1);  // revives it: parts 0 and 2 are read, part 1 is not read again
  CHECK(slot_matches(s, g, 2, 7));
  const auto& st = s.stats();
  CHECK(st.spec_parts_started.load() == 1);
  // Every byte of the record read exactly once (its span is a multiple of 4096 here).
  CHECK(st.bytes_read.load() == L.record_bytes);
  CHECK(st.revived.load() == 1);
  CHECK(StreamTesting::check_invariants(s).empty());

  // The same, released instead: nothing in flight, so limbo recycles it at once.
  const std::uint32_t key2 = 2 * g.n_experts + 8;
  std::int32_t other[] = {8};
  s.request(2, other, 1, ReadClass::Pred1);
  REQUIRE(StreamTesting::run_job(s, 0));
  CHECK(s.retire_unused_pre(2, chosen, 1) == 1);
  CHECK(StreamTesting::pending_jobs(s).empty());
  CHECK(s.release_limbo() == 1);
  CHECK(s.where(key2 / s.layout().n_experts, key2 % s.layout().n_experts) < 0);
  CHECK(StreamTesting::check_invariants(s).empty());
  std::remove(path.c_str());
}

TEST_CASE("verify_reads reports a record that changed on disk, naming layer, expert, offset") {
  TestGeometry g;
  auto path = build_test_pack(g, "verify");
  PackLayout L = read_pack_layout(path);
  for (std::uint32_t threads : {0u, 2u}) {
    CAPTURE(threads);
    StreamOptions o = small_options(8, L, threads);
    o.verify_reads = true;
    ExpertStream s(path, o);
    const std::uint32_t key = 3 * g.n_experts + 2;
    const unsigned char zeros[64] = {};
    poke(path, L.record_offset(key) + 20000, zeros, sizeof zeros);  // after the stream opened
    std::int32_t ex[] = {2, 4};
    s.request(3, ex, 2, ReadClass::Urgent);
    try {
      s.wait(3, ex, 2);
      FAIL("expected an ExpertReadError");
    } catch (const ExpertReadError& e) {
      CHECK(e.layer == 3);
      CHECK(e.expert == 2);
      CHECK(e.offset == L.record_offset(key));
      CHECK(std::string(e.what()).find("CRC32C") != std::string::npos);
    }
    s.wait(3, ex + 1, 1);  // the stream stays usable; the good record reads
    CHECK(slot_matches(s, g, 3, 4));
    CHECK(StreamTesting::check_invariants(s).empty());
    auto good = expected_record(g, 3, 2);
    poke(path, L.record_offset(key) + 20000, good.data() + 20000, sizeof zeros);
  }
  std::remove(path.c_str());
}

TEST_CASE("a record's parts are balanced over the IO threads, none above part_bytes") {
  // The function alone: equal parts of whole pages, at most the cap; a count that is a multiple
  // of the threads where the parts stay at least 64 KiB; one thread, or none, keeps the count.
  const std::uint64_t q4 = 2654208;  // a Qwen3-30B-A3B q4 g64 record's span (162 pages)
  struct Case { std::uint64_t span, cap; std::uint32_t threads; std::uint64_t want_parts; };
  for (const Case c : {Case{q4, 256 << 10, 8, 16}, Case{q4, 1 << 20, 8, 8}, Case{q4, 1 << 20, 4, 4},
                       Case{q4, 1 << 20, 1, 3}, Case{q4, 1 << 20, 0, 3}, Case{36864, kPage, 4, 3},
                       Case{49152, 256 << 10, 8, 1}, Case{300 << 10, 256 << 10, 8, 4}}) {
    CAPTURE(c.span, c.cap, c.threads);
    const std::uint64_t part = balanced_part_bytes(c.span, c.cap, c.threads);
    CHECK(part % kPage == 0);
    CHECK(part <= c.cap);
    const std::uint64_t parts = (c.span + part - 1) / part;
    // Page rounding can leave one part fewer than the count aimed at, never more.
    CHECK(parts <= c.want_parts);
    CHECK(parts + 1 >= c.want_parts);
    // What the slowest thread reads is never more than with parts of the cap.
    auto slowest = [&](std::uint64_t p) {
      const std::uint64_t n = (c.span + p - 1) / p, t = std::max<std::uint32_t>(c.threads, 1);
      return std::min(c.span, (n + t - 1) / t * p);
    };
    CHECK(slowest(part) <= slowest(c.cap));
  }

  // A stream's records read whole and verified in balanced parts: 3 MiB records, parts of at
  // most 1 MiB over 4 threads give 4 parts of 768 KiB (the CRCs combined at that length).
  TestGeometry g{2, 4, 2, 512, 512};
  auto path = build_test_pack(g, "balanced_parts");
  PackLayout L = read_pack_layout(path);
  StreamOptions o = small_options(8, L, 4);
  o.part_bytes = 1 << 20;
  o.verify_reads = true;
  ExpertStream s(path, o);
  CHECK(s.n_parts() == 4);
  CHECK(s.part_bytes() < o.part_bytes);
  for (std::uint32_t layer = 0; layer < g.n_layers; ++layer) {
    std::int32_t ex[] = {0, 1, 2, 3};
    s.request(layer, ex, 4, ReadClass::Urgent);
    s.wait(layer, ex, 4);
    for (std::uint32_t e = 0; e < g.n_experts; ++e) CHECK(slot_matches(s, g, layer, e));
  }
  CHECK(StreamTesting::check_invariants(s).empty());
  std::remove(path.c_str());
}
