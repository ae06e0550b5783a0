// QueuedBackend (exec/queued_backend.h): the device queue the CPU, CUDA and test backends share.
// A backend that records what its hooks see checks the queue's own promises: order on one
// device thread, abort_pending() waking a thread parked on a Wait and skipping the rest until
// the next drain, the first error latched until taken (a throw included), and bind() running
// with the queue drained and the device idle.
#include <catch2/catch.hpp>

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "exec/queued_backend.h"

using namespace strata;

namespace {

class RecordingBackend final : public QueuedBackend<> {
 public:
  RecordingBackend() : QueuedBackend("queued-test") { start(); }
  ~RecordingBackend() override { stop(); }
  std::string name() const override { return "recording"; }

  // What the device thread ran (Signal values, in order), read after a drain.
  std::vector<std::uint64_t> ran() {
    std::lock_guard<std::mutex> lk(mu_);
    return ran_;
  }
  bool parked() const { return parked_.load(); }
  std::size_t ran_at_bind() const { return ran_at_bind_; }
  std::size_t drains() const { return drains_; }
  std::size_t skipped_items() const { return skipped_.load(); }
  std::string drain_error;  // drained() returns it once

 private:
  void bind_idle(const DeviceBuffers&) override {
    std::lock_guard<std::mutex> lk(mu_);
    ran_at_bind_ = ran_.size();
  }
  std::string execute(const QueuedCommand& item) override {
    const Command& c = item.c;
    if (c.op == Op::Wait) {
      parked_ = true;
      c.event->wait(c.value);
      parked_ = false;
      return "";
    }
    if (c.op == Op::Route) throw std::runtime_error("a kernel threw at layer " +
                                                    std::to_string(c.layer));
    if (c.op == Op::Plan) return "error at layer " + std::to_string(c.layer);
    {
      std::lock_guard<std::mutex> lk(mu_);
      ran_.push_back(c.value);
    }
    if (c.event) c.event->signal(c.value);
    return "";
  }
  void skipped(const QueuedCommand&) override { ++skipped_; }
  std::string drained() override {
    ++drains_;  // under the queue's lock, device idle
    std::string e;
    e.swap(drain_error);
    return e;
  }

  std::mutex mu_;
  std::vector<std::uint64_t> ran_;  // mu_
  std::atomic<bool> parked_{false};
  std::atomic<std::size_t> skipped_{0};
  std::size_t ran_at_bind_ = 0, drains_ = 0;  // the queue's lock
};

Command signal(SharedEvent* e, std::uint64_t v) {
  Command c{Op::Signal};
  c.event = e;
  c.value = v;
  return c;
}
Command wait(SharedEvent* e, std::uint64_t v) {
  Command c{Op::Wait};
  c.event = e;
  c.value = v;
  return c;
}
Command failing(Op op, std::uint32_t layer) {
  Command c{op};
  c.layer = layer;
  return c;
}

}  // namespace

TEST_CASE("queued commands run in submission order, and synchronize waits for all of them") {
  RecordingBackend b;
  SharedEvent ev;
  for (std::uint64_t v = 1; v <= 40; v += 4)
    b.submit({signal(&ev, v), signal(&ev, v + 1), signal(&ev, v + 2), signal(&ev, v + 3)});
  b.synchronize();
  std::vector<std::uint64_t> want;
  for (std::uint64_t v = 1; v <= 40; ++v) want.push_back(v);
  CHECK(b.ran() == want);
  CHECK(b.take_device_error().empty());
}

TEST_CASE("abort_pending wakes a device thread parked on a Wait and skips the rest until a drain") {
  RecordingBackend b;
  SharedEvent gate, after;
  b.submit({wait(&gate, 7), signal(&after, 1), signal(&after, 2)});
  while (!b.parked()) std::this_thread::yield();  // the device thread is inside the Wait
  b.abort_pending();
  b.synchronize();  // returns: the Wait was woken, the Signals after it skipped
  CHECK(gate.value() == 7);
  CHECK(after.value() == 0);
  CHECK(b.ran().empty());
  CHECK(b.skipped_items() == 2);
  // The drain ended the abort: the next submission runs.
  b.submit({signal(&after, 3)});
  b.synchronize();
  CHECK(b.ran() == std::vector<std::uint64_t>{3});
  // An abort with nothing parked skips what is queued behind it, once more until a drain.
  SharedEvent late;
  b.submit({wait(&late, 1)});
  while (!b.parked()) std::this_thread::yield();
  b.abort_pending();
  b.submit({signal(&after, 4)});
  b.synchronize();
  CHECK(b.ran() == std::vector<std::uint64_t>{3});
}

TEST_CASE("the first device error is kept until taken, a throwing command's included") {
  RecordingBackend b;
  SharedEvent ev;
  b.submit({failing(Op::Plan, 1), failing(Op::Plan, 2), signal(&ev, 1)});
  b.synchronize();
  CHECK(b.take_device_error() == "error at layer 1");
  CHECK(b.take_device_error().empty());
  CHECK(b.ran() == std::vector<std::uint64_t>{1});  // an error does not stop the queue
  b.submit({failing(Op::Route, 3), failing(Op::Plan, 4)});
  b.synchronize();
  CHECK(b.take_device_error() == "a kernel threw at layer 3");
  b.drain_error = "the stream failed at the drain";
  b.synchronize();
  CHECK(b.take_device_error() == "the stream failed at the drain");
}

TEST_CASE("bind runs once everything submitted has run, after the backend's drain") {
  RecordingBackend b;
  SharedEvent gate, ev;
  b.submit({wait(&gate, 1), signal(&ev, 1), signal(&ev, 2)});
  std::thread release([&] {
    while (!b.parked()) std::this_thread::yield();
    gate.signal(1);
  });
  const std::size_t drains = b.drains();
  b.bind(DeviceBuffers{});  // waits for the Wait, released by the other thread
  release.join();
  CHECK(b.ran_at_bind() == 2);
  CHECK(b.drains() == drains + 1);
}
