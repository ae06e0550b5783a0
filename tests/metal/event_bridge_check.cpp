// The Metal host's EventBridge (csrc/metal/host/event_bridge.h), run on Linux against a test
// double of the device event, with a thread playing the GPU: it consumes an encoded list of
// waits and signals in order, as a command buffer does. Prints one line per check; exits 0
// only when all pass. A watchdog turns a hang into a named failure.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include "../../csrc/metal/host/event_bridge.h"

using strata::SharedEvent;
using strata::metal::DeviceEvent;
using strata::metal::EventBridge;

namespace {

// The device event: a SharedEvent of its own (the GPU's view of the value).
class FakeDeviceEvent final : public DeviceEvent {
 public:
  explicit FakeDeviceEvent(std::uint64_t initial) { ev_.signal(initial); }
  void set(std::uint64_t v) override { ev_.signal(v); }
  bool wait_until(std::uint64_t v, std::uint64_t ms) override {
    return ev_.wait_for(v, std::chrono::milliseconds(ms), nullptr, std::chrono::milliseconds(5));
  }
  std::uint64_t value() const { return ev_.value(); }

 private:
  SharedEvent ev_;
};

struct Encoded {
  bool wait;  // else signal
  SharedEvent* host;
  std::uint64_t value;
};

// Plays a command buffer: blocks on device-side waits, performs device-side signals.
void gpu(EventBridge& bridge, const std::vector<Encoded>& list, bool skip_signals = false) {
  for (const Encoded& e : list) {
    auto* dev = static_cast<FakeDeviceEvent*>(bridge.device_event(e.host));
    if (e.wait) {
      while (!dev->wait_until(e.value, 50)) {
      }
    } else if (!skip_signals) {
      dev->set(e.value);
    }
  }
}

EventBridge make_bridge() {
  return EventBridge([](std::uint64_t initial) { return std::make_unique<FakeDeviceEvent>(initial); });
}

int failures = 0;
void check(bool ok, const char* what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what);
  if (!ok) ++failures;
}

// A layer call as the Window encodes it: routed signal, release waits, done signal; the host
// answers each in turn. 200 calls in order through one bridge.
void handshake_in_order() {
  EventBridge bridge = make_bridge();
  SharedEvent routed, release1, release2, done;
  const std::uint64_t calls = 200;
  std::vector<Encoded> list;
  for (std::uint64_t v = 1; v <= calls; ++v) {
    // Encoding registers each crossing with the bridge before the buffer is committed.
    for (Encoded e : {Encoded{false, &routed, v}, Encoded{true, &release1, v},
                      Encoded{true, &release2, v}, Encoded{false, &done, v}}) {
      bridge.device_event(e.host);
      if (e.wait) bridge.device_waits_for(e.host, e.value);
      else bridge.device_will_signal(e.host, e.value);
      list.push_back(e);
    }
  }
  std::thread device([&] { gpu(bridge, list); });
  bool ordered = true;
  for (std::uint64_t v = 1; v <= calls; ++v) {
    routed.wait(v);
    ordered = ordered && done.value() == v - 1;  // the device cannot pass an unreleased wait
    release1.signal(v);
    release2.signal(v);
    done.wait(v);
  }
  device.join();
  bridge.drain_signals();
  check(ordered && done.value() == calls, "200 handshakes cross in order, each wait holds the device");
}

// The host abandons a layer call: the device is parked on a release that never comes.
void abort_releases_parked_waits() {
  EventBridge bridge = make_bridge();
  SharedEvent release, done;
  std::vector<Encoded> list = {{true, &release, 7}, {false, &done, 7}};
  bridge.device_event(&release);
  bridge.device_event(&done);
  bridge.device_waits_for(&release, 7);
  bridge.device_will_signal(&done, 7);
  std::thread device([&] { gpu(bridge, list); });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // let it park
  bridge.release_device_waits();
  device.join();
  bridge.drain_signals();
  check(release.value() == 7 && done.value() == 7,
        "release_device_waits unparks the device; its later signal still reaches the host");
}

// A command buffer failed: its signals never happen on the device.
void failed_buffer_signals_are_forwarded() {
  EventBridge bridge = make_bridge();
  SharedEvent routed, done;
  bridge.device_event(&routed);
  bridge.device_event(&done);
  bridge.device_will_signal(&routed, 3);
  bridge.device_will_signal(&done, 3);
  bridge.forward_pending_signals();
  bridge.drain_signals();
  check(routed.value() == 3 && done.value() == 3,
        "forward_pending_signals lets host waits on a failed buffer finish");
}

// An event created late starts at the host's value, so old values are already satisfied.
void twin_starts_at_host_value() {
  EventBridge bridge = make_bridge();
  SharedEvent ev;
  ev.signal(41);
  auto* dev = static_cast<FakeDeviceEvent*>(bridge.device_event(&ev));
  check(dev->value() == 41 && bridge.device_event(&ev) == dev,
        "a device twin is created once, at the host event's value");
}

}  // namespace

int main() {
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::seconds(120));
    std::fprintf(stderr, "FAIL event bridge check hung\n");
    std::_Exit(3);
  }).detach();
  handshake_in_order();
  abort_releases_parked_waits();
  failed_buffer_signals_are_forwarded();
  twin_starts_at_host_value();
  return failures == 0 ? 0 : 1;
}
