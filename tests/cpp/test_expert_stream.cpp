#include <catch2/catch.hpp>

#include <cstdio>
#include <functional>
#include <utility>

#include "common/errors.h"
#include "stream_test_util.h"
#include "residency/stream_testing.h"

using namespace strata;
using namespace strata::test;

TEST_CASE("urgent reads land, publish and match the file") {
  TestGeometry g;
  auto path = build_test_pack(g, "urgent");
  PackLayout L = read_pack_layout(path);
  ExpertStream s(path, small_options(8, L, 3));
  std::int32_t ex[] = {1, 5, 7};
  auto r = s.request(2, ex, 3, ReadClass::Urgent);
  CHECK(r.misses == 3);
  s.wait(2, ex, 3);
  for (auto e : ex) CHECK(slot_matches(s, g, 2, std::uint32_t(e)));
  r = s.request(2, ex, 3, ReadClass::Urgent);
  CHECK(r.hits == 3);
  CHECK(StreamTesting::check_invariants(s).empty());
  std::remove(path.c_str());
}

TEST_CASE("an arena below the minimum is a config error naming the minimum") {
  TestGeometry g;
  auto path = build_test_pack(g, "small");
  PackLayout L = read_pack_layout(path);
  try {
    ExpertStream s(path, small_options(3, L, 1));
    FAIL("expected a config error");
  } catch (const EngineError& e) {
    CHECK(e.kind() == ErrorKind::Config);
    CHECK(std::string(e.what()).find("at least 4 slots") != std::string::npos);
  }
  std::remove(path.c_str());
}

TEST_CASE("speculative reads publish only at the handshake (I2) and limbo is never published (I7)") {
  TestGeometry g;
  auto path = build_test_pack(g, "spec");
  PackLayout L = read_pack_layout(path);
  ExpertStream s(path, small_options(8, L, 0));  // manual IO
  std::int32_t ex[] = {3, 4};
  s.enter_layer(0);
  s.request(1, ex, 2, ReadClass::Pred1);
  while (StreamTesting::run_job(s, 0)) {
  }
  CHECK(s.smap_at(1 * g.n_experts + 3) == kAbsent);  // complete but unpublished
  CHECK(s.publish(0) == 2);
  CHECK(slot_matches(s, g, 1, 3));
  s.enter_layer(1);
  std::int32_t chosen[] = {4};
  CHECK(s.retire_unused_pre(1, chosen, 1) == 1);
  CHECK(s.smap_at(1 * g.n_experts + 3) == kAbsent);
  CHECK(StreamTesting::check_invariants(s).empty());
  CHECK(s.release_limbo() == 1);
  CHECK(s.where(1, 3) < 0);
  std::remove(path.c_str());
}

TEST_CASE("victim never picks protected slots (I4) and cancel only queued (I6)") {
  TestGeometry g;
  auto path = build_test_pack(g, "victim");
  PackLayout L = read_pack_layout(path);
  ExpertStream s(path, small_options(4, L, 0));
  std::int32_t a[] = {0, 1};
  s.request(0, a, 2, ReadClass::Urgent);
  s.wait(0, a, 2);
  s.request(1, a, 2, ReadClass::Urgent);
  s.wait(1, a, 2);
  s.enter_layer(0);
  std::int32_t v = StreamTesting::victim(s);
  REQUIRE(v >= 0);
  CHECK(s.slots()[std::uint32_t(v)].key / g.n_experts == 1);
  s.after_layer(0);  // layer 1's router may run now: both layers protected
  CHECK(StreamTesting::victim(s) == -1);
  // Speculation finds no space and stops (I9).
  std::int32_t b[] = {5};
  CHECK(s.request(2, b, 1, ReadClass::Pred2).dropped == 1);
  s.end_turn();
  std::uint8_t res[2];
  s.plan(1, a, 2, res);
  CHECK(res[0] == 1);
  CHECK(res[1] == 1);
  std::int32_t v2 = StreamTesting::victim(s);
  REQUIRE(v2 >= 0);
  CHECK(s.slots()[std::uint32_t(v2)].key / g.n_experts == 0);  // plan-pinned layer 1 kept (I8)
  s.release_plan();
  // cancel: only a queued read
  s.request(3, b, 1, ReadClass::Urgent);
  CHECK(s.cancel(3, 5));
  CHECK(s.where(3, 5) < 0);
  s.request(3, b, 1, ReadClass::Urgent);
  StreamTesting::run_job(s, 0);
  CHECK_FALSE(s.cancel(3, 5));
  CHECK(StreamTesting::check_invariants(s).empty());
  std::remove(path.c_str());
}

TEST_CASE("a failed urgent read names layer, expert, offset and errno; the stream stays usable") {
  TestGeometry g;
  auto path = build_test_pack(g, "fault");
  PackLayout L = read_pack_layout(path);
  ExpertStream s(path, small_options(8, L, 2));
  Fault f;
  f.err = 5;
  StreamTesting::faults(s).add(2 * g.n_experts + 6, 1, f);
  std::int32_t ex[] = {6};
  s.request(2, ex, 1, ReadClass::Urgent);
  try {
    s.wait(2, ex, 1);
    FAIL("expected an ExpertReadError");
  } catch (const ExpertReadError& e) {
    CHECK(e.layer == 2);
    CHECK(e.expert == 6);
    CHECK(e.err == 5);
    CHECK(e.offset == L.record_offset(2 * g.n_experts + 6) + kPage);
    CHECK(std::string(e.what()).find("layer 2 expert 6") != std::string::npos);
  }
  CHECK(s.where(2, 6) < 0);
  s.wait(2, ex, 1);  // the fault was one-shot: a retry succeeds
  CHECK(slot_matches(s, g, 2, 6));
  // A short speculative read is dropped and counted.
  Fault sr;
  sr.kind = FaultKind::ShortRead;
  StreamTesting::faults(s).add(3 * g.n_experts + 1, -1, sr);
  std::int32_t p[] = {1};
  s.request(3, p, 1, ReadClass::Pred1);
  for (int i = 0; i < 200 && s.stats().spec_failed.load() == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  CHECK(s.stats().spec_failed.load() == 1);
  CHECK(s.where(3, 1) < 0);
  CHECK(StreamTesting::check_invariants(s).empty());
  std::remove(path.c_str());
}

namespace {

ErrorKind kind_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const EngineError& e) {
    return e.kind();
  }
  FAIL("expected an EngineError");
  return ErrorKind::Pack;
}

}  // namespace

// One rule for the three bounded waits (wait(), settle(), an urgent request waiting for a free
// slot): io_timeout_s without read progress is a timeout; a wait that keeps seeing parts land
// never is, however long it lasts. No timing is asserted: each case either completes or names
// the timeout.
TEST_CASE("bounded waits time out on no progress, never on a slow but moving disk") {
  TestGeometry g;  // ~36 KiB records: three 16 KiB parts
  auto path = build_test_pack(g, "timeouts");
  PackLayout L = read_pack_layout(path);
  StreamOptions o = small_options(4, L, 1);  // the minimum arena: 2 * top_k slots
  o.io_timeout_s = 0.6;
  REQUIRE(o.part_bytes * 2 < L.record_bytes);

  SECTION("an urgent request waiting for a slot behind slow reads") {
    ExpertStream s(path, o);
    REQUIRE(s.n_parts() == 3);
    // Every slot loads an urgent expert whose three parts take 250 ms each: the first slot
    // frees after ~750 ms, longer than io_timeout_s, with a part landing every 250 ms.
    slow_down(s, L, 0, {0, 1, 2, 3}, 250);
    std::int32_t first[] = {0, 1, 2, 3};
    s.request(0, first, 4, ReadClass::Urgent);
    std::int32_t next[] = {5};
    s.request(1, next, 1, ReadClass::Urgent);  // waits for a slot, then gets one
    s.wait(1, next, 1);
    CHECK(slot_matches(s, g, 1, 5));
    CHECK(StreamTesting::check_invariants(s).empty());
  }
  SECTION("wait() and settle() behind slow reads") {
    ExpertStream s(path, o);
    slow_down(s, L, 2, {4, 6}, 250);
    std::int32_t ex[] = {4};
    s.wait(2, ex, 1);  // ~750 ms of parts landing every 250 ms
    CHECK(slot_matches(s, g, 2, 4));
    std::int32_t spec[] = {6};
    s.request(3, spec, 1, ReadClass::Pred1);
    s.request(2, spec, 1, ReadClass::Urgent);
    s.settle();
    CHECK(StreamTesting::check_invariants(s).empty());
  }
  SECTION("each of the three times out when nothing lands") {
    o.io_timeout_s = 0.2;
    ExpertStream s(path, o);
    slow_down(s, L, 0, {0, 1, 2, 3}, 1500);  // the first part alone outlasts the timeout
    std::int32_t first[] = {0, 1, 2, 3};
    s.request(0, first, 4, ReadClass::Urgent);
    std::int32_t next[] = {5};
    CHECK(kind_of([&] { s.request(1, next, 1, ReadClass::Urgent); }) == ErrorKind::Timeout);
    CHECK(kind_of([&] { s.wait(0, first, 1); }) == ErrorKind::Timeout);
    CHECK(kind_of([&] { s.settle(); }) == ErrorKind::Timeout);
    StreamTesting::faults(s).clear();
  }
  std::remove(path.c_str());
}

TEST_CASE("key() and where() range-check the layer and the expert") {
  TestGeometry g;
  auto path = build_test_pack(g, "keys");
  PackLayout L = read_pack_layout(path);
  ExpertStream s(path, small_options(8, L, 1));
  CHECK(s.key(3, 15) == 3 * 16 + 15);
  CHECK(s.where(3, 15) == -1);
  for (auto [layer, expert] : {std::pair<std::int64_t, std::int64_t>{0, 16}, {0, -1}, {4, 0},
                               {-1, 0}, {0, std::int64_t(1) << 32}}) {
    INFO("layer " << layer << " expert " << expert);
    CHECK(kind_of([&] { s.key(layer, expert); }) == ErrorKind::Config);
    CHECK(kind_of([&] { s.where(layer, expert); }) == ErrorKind::Config);
  }
  std::remove(path.c_str());
}
