// Several IO threads, real preads, random part sizes and a random host workload that follows
// the Window's handshake order. Run under ThreadSanitizer in CI.
#include <catch2/catch.hpp>

#include <atomic>
#include <cstdio>
#include <random>
#include <thread>

#include "stream_test_util.h"

using namespace strata;
using namespace strata::test;

TEST_CASE("stress: threads, parts and the handshake order keep every invariant") {
  TestGeometry g;
  g.n_layers = 6;
  g.n_experts = 12;
  g.top_k = 3;
  g.hidden = 96;
  g.moe_intermediate = 80;  // record ~92 KiB: several parts at 16-48 KiB
  auto path = build_test_pack(g, "stress");
  PackLayout L = read_pack_layout(path);
  std::mt19937 rng(1234);
  for (int round = 0; round < 6; ++round) {
    StreamOptions o = small_options(8 + std::uint32_t(rng() % 24), L, 2 + std::uint32_t(rng() % 4));
    o.part_bytes = kPage * (1 + rng() % 3);
    o.verify_reads = round % 2 == 0;
    ExpertStream s(path, o);

    // A "device" thread reads smap concurrently, as a GPU router would (relaxed view only).
    std::atomic<bool> stop{false};
    std::thread device([&] {
      std::uint64_t seen = 0;
      while (!stop.load()) {
        for (std::uint32_t k = 0; k < L.n_keys(); ++k) seen += s.smap_at(k) != kAbsent;
      }
      (void)seen;
    });

    for (int turn = 0; turn < 4; ++turn) {
      for (std::uint32_t l = 0; l < g.n_layers; ++l) {
        std::vector<std::int32_t> chosen;
        while (chosen.size() < g.top_k) {
          std::int32_t e = std::int32_t(rng() % g.n_experts);
          if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
        }
        s.enter_layer(l);
        s.request(l, chosen.data(), chosen.size(), ReadClass::Urgent);
        s.publish(l);
        for (std::uint32_t d = 1; d <= 2 && l + d < g.n_layers; ++d) {
          std::vector<std::int32_t> pred;
          for (std::uint32_t i = 0; i < g.top_k; ++i) pred.push_back(std::int32_t(rng() % g.n_experts));
          s.request(l + d, pred.data(), pred.size(), d == 1 ? ReadClass::Pred1 : ReadClass::Pred2);
        }
        s.wait(l, chosen.data(), chosen.size());
        std::vector<std::uint8_t> res(chosen.size());
        s.plan(l, chosen.data(), chosen.size(), res.data());
        for (std::size_t i = 0; i < chosen.size(); ++i) {
          REQUIRE(res[i] == 1);
          REQUIRE(slot_matches(s, g, l, std::uint32_t(chosen[i])));
        }
        s.release_plan();
        s.after_layer(l);
        s.retire_unused_pre(l, chosen.data(), chosen.size());
        s.release_limbo();
        std::string bad = s.check_invariants();
        REQUIRE(bad.empty());
      }
      s.end_turn();
    }
    stop = true;
    device.join();
    s.close();
    CHECK(s.stats().failed.load() == 0);
  }
  std::remove(path.c_str());
}
