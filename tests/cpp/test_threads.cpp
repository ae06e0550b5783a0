// Windows and ExpertStreams from several threads: two Windows sharing one arena, close() while a
// layer runs on another thread, concurrent closes, a read stuck past close(). Run under TSan and
// ASan+UBSan in CI, which is the point: these are the races and lifetimes the Python tests can
// only observe from outside. Every wait is bounded, so a regression fails instead of hanging.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>
#include <thread>

#include "common/errors.h"
#include "exec/window.h"
#include "stream_test_util.h"
#include "residency/stream_testing.h"

using namespace strata;
using namespace strata::test;

namespace {

using Outputs = std::vector<std::vector<float>>;
using Turns = std::vector<std::vector<std::vector<float>>>;  // [turn][layer] -> [T * hidden]

TestGeometry geometry() {
  TestGeometry g;
  g.n_layers = 4;
  g.n_experts = 12;
  g.top_k = 3;
  g.hidden = 64;
  g.moe_intermediate = 48;
  return g;
}

Turns make_turns(const PackLayout& L, std::uint32_t seed, const std::vector<std::uint32_t>& sizes) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  Turns turns;
  for (std::uint32_t T : sizes) {
    std::vector<std::vector<float>> layers;
    for (std::uint32_t l = 0; l < L.n_layers; ++l) {
      std::vector<float> x(std::size_t(T) * L.hidden);
      for (auto& v : x) v = nd(rng);
      layers.push_back(std::move(x));
    }
    turns.push_back(std::move(layers));
  }
  return turns;
}

Outputs run(Window& w, const PackLayout& L, const Turns& turns) {
  Outputs outs;
  for (const auto& layers : turns) {
    w.begin_turn();
    for (std::uint32_t l = 0; l < L.n_layers; ++l) {
      const std::uint32_t T = std::uint32_t(layers[l].size() / L.hidden);
      std::vector<float> out(layers[l].size());
      w.moe(l, layers[l].data(), T, out.data());
      outs.push_back(std::move(out));
    }
    w.end_turn();
  }
  return outs;
}

Outputs all_resident(const std::string& path, const PackLayout& L, const Turns& turns) {
  ExpertStream stream(path, small_options(L.n_keys(), L, 2));
  WindowOptions o;
  o.lookahead = false;
  Window w(stream, make_cpu_backend(1), o);
  return run(w, L, turns);
}

// Polls `cond` for up to 30 s.
template <class F>
bool eventually(F cond) {
  for (int i = 0; i < 15000; ++i) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

bool is_kind(const EngineError& e, ErrorKind k) { return e.kind() == k; }

}  // namespace

TEST_CASE("threads: two windows sharing a small arena stay bitwise exact, split on and off") {
  TestGeometry g = geometry();
  auto path = build_test_pack(g, "threads_two");
  PackLayout L = read_pack_layout(path);
  const Turns a = make_turns(L, 1, {7, 1, 1, 2}), b = make_turns(L, 2, {1, 5, 1});
  const Outputs want_a = all_resident(path, L, a), want_b = all_resident(path, L, b);
  for (bool split : {false, true})
    for (std::uint32_t slots : {4 * L.top_k, 6 * L.top_k})
      for (int round = 0; round < 2; ++round) {
        StreamOptions so = small_options(slots, L, 3);
        so.io_spin_us = round == 1 ? 100 : 0;  // the second round's IO and waits spin first
        ExpertStream stream(path, so);
        WindowOptions wo;
        wo.split_turn = split;
        wo.max_rows = 4;
        wo.two_layer_prompt = wo.two_layer_decode = true;
        Window wa(stream, make_cpu_backend(2), wo), wb(stream, make_cpu_backend(1), wo);
        Outputs got_a, got_b;
        std::string err_a, err_b;
        std::thread ta([&] {
          try {
            got_a = run(wa, L, a);
          } catch (const std::exception& e) {
            err_a = e.what();
          }
        });
        std::thread tb([&] {
          try {
            got_b = run(wb, L, b);
          } catch (const std::exception& e) {
            err_b = e.what();
          }
        });
        ta.join();
        tb.join();
        INFO("split " << split << " slots " << slots << " round " << round);
        REQUIRE(err_a.empty());
        REQUIRE(err_b.empty());
        REQUIRE(got_a == want_a);
        REQUIRE(got_b == want_b);
        REQUIRE(StreamTesting::check_invariants(stream).empty());
      }
  std::remove(path.c_str());
}

TEST_CASE("threads: close() from another thread waits for the layer in flight, then fails the turn") {
  TestGeometry g = geometry();
  auto path = build_test_pack(g, "threads_close");
  PackLayout L = read_pack_layout(path);
  const Turns turns = make_turns(L, 3, {1});
  const Outputs want = all_resident(path, L, turns);
  for (bool split : {false, true}) {
    ExpertStream stream(path, small_options(2 * L.top_k, L, 2));
    for (std::uint32_t e = 0; e < L.n_experts; ++e) {  // every layer-1 read is slow
      Fault slow;
      slow.kind = FaultKind::Delay;
      slow.delay_ms = 20;
      slow.remaining = -1;
      StreamTesting::faults(stream).add(1 * L.n_experts + e, -1, slow);
    }
    WindowOptions wo;
    wo.split_turn = split;
    wo.lookahead = false;
    Window w(stream, make_cpu_backend(2), wo);
    std::atomic<bool> entered{false};
    Outputs got;
    bool closed_error = false;
    std::string other_error;
    std::thread t([&] {
      try {
        for (int i = 0; i < 1000; ++i) {  // until close() fails a turn
          entered = true;
          Outputs o = run(w, L, turns);
          got.insert(got.end(), o.begin(), o.end());
        }
      } catch (const EngineError& e) {
        closed_error = is_kind(e, ErrorKind::Closed);
        if (!closed_error) other_error = e.what();
      }
    });
    REQUIRE(eventually([&] { return entered.load(); }));
    std::this_thread::sleep_for(std::chrono::milliseconds(30));  // likely inside a layer
    w.close();
    t.join();
    INFO(other_error);
    REQUIRE(closed_error);
    for (std::size_t i = 0; i < got.size(); ++i) REQUIRE(got[i] == want[i % want.size()]);
    REQUIRE(w.closed());
    REQUIRE(w.scratch_bytes() == 0);
    REQUIRE(StreamTesting::check_invariants(stream).empty());
  }
  std::remove(path.c_str());
}

TEST_CASE("threads: a turn belongs to the thread that opened it") {
  TestGeometry g = geometry();
  auto path = build_test_pack(g, "threads_owner");
  PackLayout L = read_pack_layout(path);
  ExpertStream stream(path, small_options(3 * L.top_k, L, 2));
  Window w(stream, make_cpu_backend(1), WindowOptions{});
  std::vector<float> x(L.hidden, 0.25f), out(L.hidden);
  w.begin_turn();
  w.moe(0, x.data(), 1, out.data());
  int turn_errors = 0;
  std::thread t([&] {
    for (auto f : {+[](Window& w, float* x, float* o) { w.moe(1, x, 1, o); },
                   +[](Window& w, float*, float*) { w.end_turn(); },
                   +[](Window& w, float*, float*) { w.begin_turn(); }}) {
      try {
        f(w, x.data(), out.data());
      } catch (const EngineError& e) {
        turn_errors += is_kind(e, ErrorKind::Turn);
      }
    }
  });
  t.join();
  REQUIRE(turn_errors == 3);
  w.moe(1, x.data(), 1, out.data());  // the owner's turn goes on
  w.end_turn();
  std::remove(path.c_str());
}

TEST_CASE("threads: closing the stream closes its windows first; concurrent closes are safe") {
  TestGeometry g = geometry();
  auto path = build_test_pack(g, "threads_stream_close");
  PackLayout L = read_pack_layout(path);
  const Turns turns = make_turns(L, 4, {1, 2});
  for (int round = 0; round < 3; ++round) {
    ExpertStream stream(path, small_options(4 * L.top_k, L, 2));
    Window busy(stream, make_cpu_backend(1), WindowOptions{});
    Window idle(stream, make_cpu_backend(1), WindowOptions{});
    std::atomic<bool> entered{false};
    bool closed_error = false;
    std::thread t([&] {
      try {
        for (int i = 0; i < 100000; ++i) {
          entered = true;
          run(busy, L, turns);
        }
      } catch (const EngineError& e) {
        closed_error = is_kind(e, ErrorKind::Closed);
      }
    });
    REQUIRE(eventually([&] { return entered.load(); }));
    std::vector<std::thread> closers;
    for (int i = 0; i < 3; ++i) closers.emplace_back([&] { stream.close(); });
    closers.emplace_back([&] { busy.close(); });
    closers.emplace_back([&] { idle.close(); });
    for (auto& c : closers) c.join();
    t.join();
    REQUIRE(closed_error);
    REQUIRE(stream.closed());
    REQUIRE(busy.closed());
    REQUIRE(idle.closed());
    REQUIRE_THROWS_AS(Window(stream, make_cpu_backend(1), WindowOptions{}), EngineError);
  }
  std::remove(path.c_str());
}

TEST_CASE("threads: a read stuck past close() keeps the arena alive until it returns") {
  TestGeometry g = geometry();
  auto path = build_test_pack(g, "threads_stuck");
  PackLayout L = read_pack_layout(path);
  auto stream = std::make_unique<ExpertStream>(path, small_options(2 * L.top_k, L, 1));
  Fault stuck;
  stuck.kind = FaultKind::Delay;
  stuck.delay_ms = 400;
  StreamTesting::faults(*stream).add(0, -1, stuck);  // layer 0 expert 0, every part
  const std::int32_t e0 = 0;
  stream->request(0, &e0, 1, ReadClass::Urgent);
  REQUIRE(eventually([&] {
    for (const SlotInfo& s : stream->slots())
      if (s.key == 0 && s.parts_started > 0) return true;
    return false;
  }));
  REQUIRE_FALSE(stream->close(0.02));  // bounded: the read is still in the kernel
  REQUIRE(stream->closed());
  REQUIRE(stream->describe_in_flight().find("layer 0 expert 0") != std::string::npos);
  REQUIRE_FALSE(stream->close(0.0));  // a second closer is bounded too, and joins nothing
  ExpertStream::dispose(std::move(stream), 0.0);  // freed by a background thread, later
  REQUIRE(eventually([] { return ExpertStream::disposing() == 0; }));
  std::remove(path.c_str());
}
