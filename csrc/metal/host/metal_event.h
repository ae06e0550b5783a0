// The Metal device event: an MTLSharedEvent behind the bridge's DeviceEvent interface.
#pragma once

#include <Metal/Metal.hpp>

#include "event_bridge.h"

namespace strata::metal {

class MetalEvent final : public DeviceEvent {
 public:
  MetalEvent(MTL::Device* device, std::uint64_t initial) : ev_(device->newSharedEvent()) {
    ev_->setSignaledValue(initial);
  }
  ~MetalEvent() override { ev_->release(); }
  MetalEvent(const MetalEvent&) = delete;
  MetalEvent& operator=(const MetalEvent&) = delete;

  void set(std::uint64_t value) override { ev_->setSignaledValue(value); }
  bool wait_until(std::uint64_t value, std::uint64_t ms) override {
    return ev_->waitUntilSignaledValue(value, ms);
  }
  MTL::SharedEvent* mtl() const { return ev_; }

 private:
  MTL::SharedEvent* ev_;
};

}  // namespace strata::metal
