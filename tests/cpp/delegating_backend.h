// A backend that hands every call to another (the CPU backend by default): the tests' one way to
// make a backend that differs from the CPU reference in one or two calls (a name, a refused
// capability, a failing bind, counted submissions, a record observer, device memory). Override
// only what differs; everything else is the inner backend's, so its device queue and kernels
// are the reference's.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "exec/backend.h"

namespace strata::test {

class DelegatingBackend : public Backend {
 public:
  explicit DelegatingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}
  explicit DelegatingBackend(unsigned cpu_threads = 1)
      : DelegatingBackend(make_cpu_backend(cpu_threads)) {}

  std::string name() const override { return inner_->name(); }
  std::optional<std::string> unsupported(const Capability& c) const override {
    return inner_->unsupported(c);
  }
  void bind(const DeviceBuffers& buffers) override { inner_->bind(buffers); }
  void set_device_io(const DeviceIo& io) override { inner_->set_device_io(io); }
  RecordObserver* record_observer() override { return inner_->record_observer(); }
  std::chrono::microseconds host_spin() const override { return inner_->host_spin(); }
  bool completes_async() const override { return inner_->completes_async(); }
  void submit(const std::vector<Command>& commands) override { inner_->submit(commands); }
  void synchronize() override { inner_->synchronize(); }
  void abort_pending() override { inner_->abort_pending(); }
  std::string take_device_error() override { return inner_->take_device_error(); }

 protected:
  Backend& inner() { return *inner_; }
  const Backend& inner() const { return *inner_; }

 private:
  std::unique_ptr<Backend> inner_;
};

}  // namespace strata::test
