// The handshake's SharedEvents on a GPU. The Window signals and waits on strata::SharedEvent
// (host objects); a command buffer can only wait on or signal an MTL::SharedEvent. Each host
// event gets one MTL::SharedEvent, and two threads carry values across, in encoding order:
//  - host -> device: for each encoded Wait(e, v), wait until the host event reaches v, then set
//    the MTL event's value (the GPU is blocked on encodeWait until then);
//  - device -> host: for each encoded Signal(e, v), wait (waitUntilSignaledValue) until the GPU
//    signalled v, then signal the host event.
// Both are blocking waits, not polls: a crossing costs a thread wake-up on top of the event.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "exec/shared_event.h"

namespace MTL {
class Device;
class SharedEvent;
}  // namespace MTL

namespace strata::metal {

class EventBridge {
 public:
  explicit EventBridge(MTL::Device* device);
  ~EventBridge();
  EventBridge(const EventBridge&) = delete;
  EventBridge& operator=(const EventBridge&) = delete;

  // The device twin of a host event, created on first use at the host event's current value.
  MTL::SharedEvent* device_event(SharedEvent* host);

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

  MTL::Device* device_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<SharedEvent*, MTL::SharedEvent*> twins_;  // mu_
  std::deque<Crossing> waits_;                        // mu_: host -> device, in order
  std::deque<Crossing> signals_;                      // mu_: device -> host, in order
  bool signal_in_flight_ = false;                     // mu_: device_to_host is forwarding one
  bool force_signals_ = false;                        // mu_: forward without the GPU (failure)
  bool stop_ = false;                                 // mu_
  std::thread to_device_, to_host_;                   // last: start after the fields exist
};

}  // namespace strata::metal
