// Several IO threads, real preads, random part sizes and a random host workload that follows
// the Window's handshake order, with a "device" thread that executes each layer as a GPU would:
// it finds the routed experts' slots through smap and reads every byte of them while the host
// queues the next layers' speculation (which may evict whatever the rules allow). A stale
// address (a slot recycled or rewritten under the device) shows up as bytes that are not the
// expert's record. Run under ThreadSanitizer in CI.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <random>
#include <string>
#include <thread>

#include "stream_test_util.h"
#include "residency/stream_testing.h"

using namespace strata;
using namespace strata::test;

namespace {

// The device side of the handshake: the host posts a layer with its routed experts after the
// plan (I8) and before after_layer; the device reads them and reports done.
class Device {
 public:
  Device(const ExpertStream& s, const TestGeometry& g) : s_(s), g_(g) {
    for (std::uint32_t l = 0; l < g.n_layers; ++l)
      for (std::uint32_t e = 0; e < g.n_experts; ++e) records_.push_back(expected_record(g, l, e));
    thread_ = std::thread([this] { run(); });
  }
  ~Device() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void execute(std::uint32_t layer, const std::vector<std::int32_t>& experts) {
    std::lock_guard<std::mutex> lk(mu_);
    layer_ = layer;
    experts_ = experts;
    pending_ = true;
    cv_.notify_all();
  }
  void finish() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [this] { return !pending_; });
  }
  std::uint64_t checked() const { return checked_.load(); }
  std::string failure() {
    std::lock_guard<std::mutex> lk(mu_);
    return failure_;
  }

 private:
  void run() {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_.wait(lk, [this] { return stop_ || pending_; });
      if (stop_) return;
      const std::uint32_t layer = layer_;
      const std::vector<std::int32_t> experts = experts_;
      lk.unlock();
      std::string bad;
      // Several passes, so that the reads overlap the host's speculation for l+1 and l+2.
      for (int pass = 0; pass < 3 && bad.empty(); ++pass)
        for (std::int32_t e : experts) {
          const std::uint32_t key = layer * g_.n_experts + std::uint32_t(e);
          const std::uint32_t slot = s_.smap_at(key);  // acquire: the bytes are visible
          if (slot == kAbsent) {
            bad = "layer " + std::to_string(layer) + " expert " + std::to_string(e) +
                  " unpublished while the device executes it";
            break;
          }
          const auto& want = records_[key];
          if (std::memcmp(s_.arena().slot(slot), want.data(), want.size()) != 0) {
            bad = "slot " + std::to_string(slot) + " does not hold layer " + std::to_string(layer) +
                  " expert " + std::to_string(e) + " while the device reads it (stale address)";
            break;
          }
          checked_.fetch_add(1);
        }
      lk.lock();
      if (!bad.empty() && failure_.empty()) failure_ = bad;
      pending_ = false;
      cv_.notify_all();
    }
  }

  const ExpertStream& s_;
  const TestGeometry g_;
  std::vector<std::vector<unsigned char>> records_;  // immutable after construction
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, pending_ = false;   // mu_
  std::uint32_t layer_ = 0;               // mu_
  std::vector<std::int32_t> experts_;     // mu_
  std::string failure_;                   // mu_
  std::atomic<std::uint64_t> checked_{0};
  std::thread thread_;
};

}  // namespace

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
  std::uint64_t device_reads = 0;
  for (int round = 0; round < 6; ++round) {
    StreamOptions o = small_options(8 + std::uint32_t(rng() % 24), L, 2 + std::uint32_t(rng() % 4));
    o.part_bytes = kPage * (1 + rng() % 3);
    o.verify_reads = round % 2 == 0;
    o.io_spin_us = round % 3 == 1 ? 50 : 0;  // IO threads and waits spinning without mu_
    ExpertStream s(path, o);
    Device device(s, g);

    for (int turn = 0; turn < 4; ++turn) {
      for (std::uint32_t l = 0; l < g.n_layers; ++l) {
        std::vector<std::int32_t> chosen;
        while (chosen.size() < g.top_k) {
          std::int32_t e = std::int32_t(rng() % g.n_experts);
          if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
        }
        s.enter_layer(l, chosen.data(), chosen.size());
        s.request(l, chosen.data(), chosen.size(), ReadClass::Urgent);
        s.publish(l);
        s.wait(l, chosen.data(), chosen.size());
        std::vector<std::uint8_t> res(chosen.size());
        s.plan(l, chosen.data(), chosen.size(), res.data());
        for (std::size_t i = 0; i < chosen.size(); ++i) REQUIRE(res[i] == 1);
        device.execute(l, chosen);  // the device reads while speculation runs
        for (std::uint32_t d = 1; d <= 2 && l + d < g.n_layers; ++d) {
          std::vector<std::int32_t> pred;
          for (std::uint32_t i = 0; i < 2 * g.top_k; ++i)
            pred.push_back(std::int32_t(rng() % g.n_experts));
          s.request(l + d, pred.data(), pred.size(), d == 1 ? ReadClass::Pred1 : ReadClass::Pred2);
        }
        device.finish();
        INFO("round " << round << " turn " << turn << " layer " << l);
        REQUIRE(device.failure().empty());
        s.release_plan();
        s.after_layer(l);
        s.retire_unused_pre(l, chosen.data(), chosen.size());
        s.release_limbo();
        std::string bad = StreamTesting::check_invariants(s);
        REQUIRE(bad.empty());
      }
      s.end_turn();
    }
    device_reads += device.checked();
    s.close();
    CHECK(s.stats().failed.load() == 0);
  }
  CHECK(device_reads >= 6 * 4 * 6 * 3);  // every executed expert was read at least once
  std::remove(path.c_str());
}
