// The handshake's SharedEvents on a GPU. The Window signals and waits on strata::SharedEvent
// (host objects); a command buffer can only wait on or signal an MTL::SharedEvent. Each host
// event gets one MTL::SharedEvent, and two threads carry values across, in encoding order:
//  - host -> device: for each encoded Wait(e, v), wait until the host event reaches v, then set
//    the MTL event's value (the GPU is blocked on encodeWait until then);
//  - device -> host: for each encoded Signal(e, v), wait (waitUntilSignaledValue) until the GPU
//    signalled v, then signal the host event.
// Both are blocking waits, not polls: a crossing costs a thread wake-up on top of the event.
// The device event is an interface so this logic runs on Linux against a test double
// (tests/metal/event_bridge_check.cpp); the Metal one is in metal_event.h.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "exec/shared_event.h"

namespace strata::metal {

// The device side of one event: on macOS an MTLSharedEvent.
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  virtual void set(std::uint64_t value) = 0;
  // Blocks until the value reaches `value` or `ms` pass; true when it was reached.
  virtual bool wait_until(std::uint64_t value, std::uint64_t ms) = 0;
};
using DeviceEventFactory = std::function<std::unique_ptr<DeviceEvent>(std::uint64_t initial)>;

class EventBridge {
 public:
  explicit EventBridge(DeviceEventFactory make_event);
  ~EventBridge();
  EventBridge(const EventBridge&) = delete;
  EventBridge& operator=(const EventBridge&) = delete;

  // The device twin of a host event, created on first use at the host event's current value.
  DeviceEvent* device_event(SharedEvent* host);

  // Called while encoding, in encoding order.
  void device_waits_for(SharedEvent* host, std::uint64_t value);
  void device_will_signal(SharedEvent* host, std::uint64_t value);

  // Abort: every encoded device wait is satisfied now (and its host event reaches the value,
  // as the CPU backend does for the wait it is parked on).
  void release_device_waits();
  // A command buffer failed: its encoded signals will never come; forward them all now.
  void forward_pending_signals();
  // Blocks until every encoded signal has reached its host event.
  void drain_signals();

 private:
  void host_to_device_loop();
  void device_to_host_loop();

  struct Crossing {
    SharedEvent* host;
    std::uint64_t value;
  };

  DeviceEventFactory make_event_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<SharedEvent*, std::unique_ptr<DeviceEvent>> twins_;  // mu_; entries never erased
  std::deque<Crossing> waits_;                        // mu_: host -> device, in order
  std::deque<Crossing> signals_;                      // mu_: device -> host, in order
  bool signal_in_flight_ = false;                     // mu_: device_to_host is forwarding one
  bool force_signals_ = false;                        // mu_: forward without the GPU (failure)
  bool stop_ = false;                                 // mu_
  std::thread to_device_, to_host_;                   // last: start after the fields exist
};

}  // namespace strata::metal
