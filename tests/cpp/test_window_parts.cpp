// The Window's parts alone, without a stream or a backend: TurnGate (admission, turn order,
// close), Completion (the pending-completion transitions), the routed inputs (checked once,
// staged once), Popularity and the Recorder's figures (docs/architecture.md section 2).
#include <catch2/catch.hpp>

#include <atomic>
#include <functional>
#include <stdexcept>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "exec/completion.h"
#include "exec/popularity.h"
#include "exec/recorder.h"
#include "exec/routed.h"
#include "exec/turn_gate.h"

using namespace strata;

namespace {

ErrorKind kind_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const EngineError& e) {
    return e.kind();
  }
  FAIL("no EngineError");
  return ErrorKind::Pack;
}

PackLayout layout(std::uint32_t n_layers, std::uint32_t n_experts, std::uint32_t top_k) {
  PackLayout L;
  L.n_layers = n_layers;
  L.n_experts = n_experts;
  L.top_k = top_k;
  L.classes.resize(1);
  return L;
}

}  // namespace

TEST_CASE("TurnGate opens an implicit turn at layer 0 and keeps the layer order", "[parts]") {
  TurnGate g;
  TurnGate::Call call(g);
  CHECK(kind_of([&] { g.enter(1, 1); }) == ErrorKind::Turn);  // outside a turn
  CHECK(g.enter(0, 0) == TurnGate::Entry::Skip);               // nothing to run, nothing opened
  CHECK_FALSE(g.in_turn());
  CHECK(g.enter(0, 3) == TurnGate::Entry::Opens);
  CHECK(g.in_turn());
  CHECK_FALSE(g.advance(0, 3));
  CHECK(g.next_layer() == 1);
  CHECK(kind_of([&] { g.enter(2, 1); }) == ErrorKind::Turn);  // out of order
  CHECK(g.enter(1, 0) == TurnGate::Entry::Skip);
  CHECK(g.enter(1, 1) == TurnGate::Entry::Continue);
  CHECK_FALSE(g.advance(1, 3));
  CHECK(g.enter(2, 1) == TurnGate::Entry::Continue);
  CHECK(g.advance(2, 3));  // the implicit turn's last layer
  CHECK(g.next_layer() == 0);
  g.close_turn();
  CHECK_FALSE(g.in_turn());
}

TEST_CASE("TurnGate: a passed layer opens and continues the turn as a call of rows does",
          "[parts]") {
  TurnGate g;
  TurnGate::Call call(g);
  CHECK(g.enter(0, 0, /*pass=*/true) == TurnGate::Entry::Opens);  // an empty call would Skip
  CHECK(g.in_turn());
  CHECK_FALSE(g.advance(0, 3));
  CHECK(kind_of([&] { g.enter(2, 0, true); }) == ErrorKind::Turn);  // out of order all the same
  CHECK(g.enter(1, 0, true) == TurnGate::Entry::Continue);
  CHECK_FALSE(g.advance(1, 3));
  CHECK(g.enter(2, 0, true) == TurnGate::Entry::Continue);
  CHECK(g.advance(2, 3));  // the implicit turn ends after its last layer, passed or run
}

TEST_CASE("TurnGate: an explicit turn never ends by the layer count", "[parts]") {
  TurnGate g;
  TurnGate::Call call(g);
  CHECK_FALSE(g.implicit_open());
  g.open_explicit();
  CHECK(kind_of([&] { g.implicit_open(); }) == ErrorKind::Turn);  // one is open already
  CHECK(g.enter(0, 1) == TurnGate::Entry::Continue);
  CHECK_FALSE(g.advance(0, 1));
  CHECK(g.in_turn());
}

TEST_CASE("TurnGate admits one call, on the turn owner's thread", "[parts]") {
  TurnGate g;
  {
    TurnGate::Call call(g);
    g.enter(0, 1);  // this thread owns the implicit turn now
    ErrorKind busy = ErrorKind::Pack;
    std::thread([&] { busy = kind_of([&] { TurnGate::Call other(g); }); }).join();
    CHECK(busy == ErrorKind::Turn);
  }
  ErrorKind owned = ErrorKind::Pack;
  std::thread([&] { owned = kind_of([&] { TurnGate::Call other(g); }); }).join();
  CHECK(owned == ErrorKind::Turn);  // not busy, but the turn is this thread's
  TurnGate::Call again(g);          // its owner gets in
  CHECK(again.admitted());
}

TEST_CASE("TurnGate: close waits for the call in flight, then refuses every call", "[parts]") {
  TurnGate g;
  std::atomic<bool> inside{false}, release{false}, closed{false};
  std::thread caller([&] {
    TurnGate::Call call(g);
    inside = true;
    while (!release) std::this_thread::yield();
  });
  while (!inside) std::this_thread::yield();
  std::thread closer([&] {
    if (g.begin_close()) g.finish_close();
    closed = true;
  });
  while (!g.closed()) std::this_thread::yield();  // Closing from the moment close began
  CHECK_FALSE(closed.load());  // and it cannot finish while the call is inside
  release = true;
  caller.join();
  closer.join();
  CHECK(closed.load());
  CHECK(kind_of([&] { TurnGate::Call call(g); }) == ErrorKind::Closed);
  TurnGate::Call quiet(g, /*closed_ok=*/true);
  CHECK_FALSE(quiet.admitted());
  CHECK_FALSE(g.begin_close());  // idempotent
}

TEST_CASE("TurnGate: close from inside one of the gate's own calls is a Turn error", "[parts]") {
  TurnGate g;
  TurnGate::Call call(g);
  CHECK(kind_of([&] { g.begin_close(); }) == ErrorKind::Turn);
  CHECK_FALSE(g.closed());
}

TEST_CASE("Completion: the deferred states in order, and the drain that ends them", "[parts]") {
  Completion c;
  CHECK_FALSE(c.pending());
  c.defer_chunk();
  c.defer_chunk();  // a later chunk of the same call
  CHECK(c.state() == Completion::State::ChunkPending);
  c.defer_layer();
  CHECK(c.state() == Completion::State::LayerPending);
  CHECK(c.drained() == Completion::State::LayerPending);
  CHECK_FALSE(c.pending());

  c.defer_chunk();
  c.defer_layer();
  c.defer_turn_end(/*prompt=*/true);
  CHECK(c.pending());
  CHECK(c.drained() == Completion::State::TurnEndPending);  // the turn end is the caller's
  CHECK(c.take_turn_prompt());
  CHECK_FALSE(c.take_turn_prompt());
  CHECK(c.drained() == Completion::State::Done);
}

TEST_CASE("Completion::pending is readable from another thread", "[parts]") {
  Completion c;
  c.defer_chunk();
  bool seen = false;
  std::thread([&] { seen = c.pending(); }).join();
  CHECK(seen);
}

TEST_CASE("Popularity ranks by how many entries chose each expert, ties to the lower id",
          "[parts]") {
  Popularity p(8);
  std::vector<std::int32_t> out;
  const std::vector<std::int32_t> ids = {5, 2, 7, 2, 5, 1, 2, 7};
  p.rank(ids.data(), std::uint32_t(ids.size()), out);
  CHECK(out == std::vector<std::int32_t>{2, 5, 7, 1});
  p.rank(ids.data(), 2, out);  // its counts start from zero again
  CHECK(out == std::vector<std::int32_t>{2, 5});
}

TEST_CASE("stage_routed copies a chunk's rows once and counts their distinct experts",
          "[parts]") {
  const std::uint32_t k = 2;
  const std::vector<std::int32_t> ids = {0, 1, 3, 1, 3, 3, 2, 0};  // 4 rows
  const std::vector<float> w = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<std::int32_t> p1 = {4, 5, 6, 7, 0, 1, 2, 3};
  Routed r;
  r.ids = ids.data();
  r.weights = w.data();
  r.pred1 = p1.data();
  std::vector<std::int32_t> s_ids(4, -1), s_p1(4, -1), s_p2(4, -7);
  std::vector<float> s_w(4, 0);
  DeviceBuffers b;
  b.ids = s_ids.data();
  b.weights = s_w.data();
  b.pred_ids[0] = s_p1.data();
  b.pred_ids[1] = s_p2.data();
  std::vector<char> marks(4, 0);
  CHECK(stage_routed(r, k, 1, 2, b, marks) == 2);  // rows 1-2: {3, 1, 3, 3}
  CHECK(s_ids == std::vector<std::int32_t>{3, 1, 3, 3});
  CHECK(s_w == std::vector<float>{3, 4, 5, 6});
  CHECK(s_p1 == std::vector<std::int32_t>{6, 7, 0, 1});
  CHECK(s_p2 == std::vector<std::int32_t>(4, -7));  // no pred2 given: untouched
  CHECK(marks == std::vector<char>(4, 0));
}

TEST_CASE("check_routed names what a routed call cannot have, before anything runs",
          "[parts]") {
  const PackLayout L = layout(3, 4, 2);
  BackendSupport support = BackendSupport::all(L);
  const std::vector<std::int32_t> ids = {0, 1, 3, 2}, bad = {0, 1, 4, 2};
  const std::vector<float> w(4, 1.0f);
  Routed r;
  r.ids = ids.data();
  r.weights = w.data();
  CHECK_NOTHROW(check_routed(r, 1, 2, true, L, support, MoceMode::Off));
  CHECK(kind_of([&] { check_routed(r, 1, 2, true, L, support, MoceMode::Scale); }) ==
        ErrorKind::Config);
  Routed p = r;
  p.pred1 = bad.data();
  CHECK_THROWS_WITH(check_routed(p, 1, 2, true, L, support, MoceMode::Off),
                    "expert id 4 at entry 2 out of range [0, 4)");
  Routed unweighted = r;
  unweighted.weights = nullptr;
  CHECK_THROWS_AS(check_routed(unweighted, 1, 2, true, L, support, MoceMode::Off),
                  std::invalid_argument);
  CHECK_NOTHROW(check_routed(unweighted, 1, 2, false, L, support, MoceMode::Off));
  support.class_arithmetic[0][std::size_t(Arithmetic::MlxBfloat16)] = "no mlx here";
  Routed mlx = r;
  mlx.rounding.arithmetic = Arithmetic::MlxBfloat16;
  CHECK_THROWS_WITH(check_routed(mlx, 1, 2, true, L, support, MoceMode::Off), "no mlx here");
}

TEST_CASE("Recorder: the profile and routes learn a pass, precision scores router l+1",
          "[parts]") {
  const PackLayout L = layout(2, 4, 2);
  Recorder rec(L, /*record_routes=*/true);
  rec.begin_pass(2);
  const std::vector<std::int32_t> ids0 = {0, 1, 1, 2};  // 2 rows at layer 0
  rec.learn(0, 0, ids0.data(), 2);
  CHECK(rec.profile() == std::vector<std::uint32_t>{1, 2, 1, 0, 0, 0, 0, 0});
  CHECK(rec.take_routes() == std::vector<std::int32_t>{0, 0, 0, 0, 0, 1, 1, 0, 1, 1, 0, 2});
  rec.note_predicted(1, 0, {3, 1, 2});  // router 1 on layer 0's input, chunk 0
  LayerStats s;
  rec.score_predicted(1, 0, {1, 0}, s);  // what layer 1 chose: one of three right
  CHECK(s.pred_correct == 1);
  CHECK(s.pred_predicted == 3);
  CHECK(s.pred_actual == 2);
  rec.score_predicted(1, 0, {1, 0}, s);  // scored once: the note is gone
  CHECK(s.pred_predicted == 3);
  rec.add_host_time(1, HostTimer{}, s);  // with a host point's time, under one lock hold
  CHECK(rec.layer_stats()[1].pred_correct == 1);
  CHECK(rec.layer_stats()[1].pred_actual == 2);
  rec.begin_pass(1);  // the next pass's tokens count on
  rec.learn(0, 0, ids0.data(), 1);
  CHECK(rec.take_routes() == std::vector<std::int32_t>{2, 0, 0, 2, 0, 1});
  rec.reset_stats();
  CHECK(rec.layer_stats()[1].pred_predicted == 0);
}
