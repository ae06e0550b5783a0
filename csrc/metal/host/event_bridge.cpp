#include "event_bridge.h"

#include "common/thread_name.h"

namespace strata::metal {
namespace {
constexpr auto kPoll = std::chrono::milliseconds(50);  // how often a blocked wait checks stop_
}

EventBridge::EventBridge(DeviceEventFactory make_event)
    : make_event_(std::move(make_event)),
      to_device_([this] {
        name_this_thread("strata-to-gpu");
        host_to_device_loop();
      }),
      to_host_([this] {
        name_this_thread("strata-to-cpu");
        device_to_host_loop();
      }) {}

EventBridge::~EventBridge() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  to_device_.join();
  to_host_.join();
}

DeviceEvent* EventBridge::device_event(SharedEvent* host) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = twins_.find(host);
  if (it == twins_.end()) it = twins_.emplace(host, make_event_(host->value())).first;
  return it->second.get();
}

void EventBridge::device_waits_for(SharedEvent* host, std::uint64_t value) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    waits_.push_back({host, value});
  }
  cv_.notify_all();
}

void EventBridge::device_will_signal(SharedEvent* host, std::uint64_t value) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    signals_.push_back({host, value});
  }
  cv_.notify_all();
}

void EventBridge::release_device_waits() {
  std::deque<Crossing> pending;
  {
    std::lock_guard<std::mutex> lk(mu_);
    pending.swap(waits_);
  }
  for (const Crossing& c : pending) {
    c.host->signal(c.value);  // the host_to_device thread, if parked on it, forwards it too
    device_event(c.host)->set(c.value);
  }
  cv_.notify_all();
}

void EventBridge::forward_pending_signals() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    force_signals_ = true;
  }
  cv_.notify_all();
}

void EventBridge::drain_signals() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return signals_.empty() && !signal_in_flight_; });
  force_signals_ = false;
}

void EventBridge::host_to_device_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || !waits_.empty(); });
    if (stop_) return;
    const Crossing c = waits_.front();
    lk.unlock();
    // Blocks on the host event's condition variable; wakes every kPoll only to check stop_.
    bool reached = c.host->wait_for(c.value, kPoll, nullptr, kPoll);
    lk.lock();
    if (!reached) continue;  // still waiting (or the wait was released and popped: re-check)
    if (!waits_.empty() && waits_.front().host == c.host && waits_.front().value == c.value)
      waits_.pop_front();
    DeviceEvent* twin = twins_.at(c.host).get();
    lk.unlock();
    twin->set(c.value);
    lk.lock();
  }
}

void EventBridge::device_to_host_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || !signals_.empty(); });
    if (stop_) return;
    const Crossing c = signals_.front();
    signal_in_flight_ = true;
    DeviceEvent* twin = twins_.at(c.host).get();
    bool reached = force_signals_;
    lk.unlock();
    if (!reached) reached = twin->wait_until(c.value, std::uint64_t(kPoll.count()));
    if (reached) c.host->signal(c.value);
    lk.lock();
    if (reached) signals_.pop_front();
    signal_in_flight_ = false;
    cv_.notify_all();
  }
}

}  // namespace strata::metal
