// QueuedBackend: the device queue every backend with a device thread shares (the CPU reference,
// the CUDA host, the tests' late-kernel backend). The host submits commands; one device thread
// takes them in order and runs each through the backend's execute(), outside the lock; a Wait
// parks that thread on its SharedEvent exactly as a GPU waits on the host. The subtle parts live
// here once: abort_pending() waking a thread parked on a Wait, synchronize() draining to idle,
// the first-error latch, binding only while the device thread is idle, and stopping.
//
// A backend extends it with two hooks, both run on a device it may treat as idle or its own:
//   bind_idle(buffers): the new buffers, with the queue drained and the lock held;
//   execute(item):      one command, on the device thread, without the lock; returns an error
//                       ("" when none), which the latch keeps if it is the first.
// and may refine how a submission is queued (enqueue), what a skipped item leaves behind
// (skipped) and what a drain adds (drained). A derived constructor calls start() last, and its
// destructor stop() first: the device thread calls the hooks, which must not outlive it.
//
// Header-only: the CUDA host (strata_stream._cuda) shares with _core only header-only engine
// types (cuda/host/factory.h), so it compiles its own copy.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/thread_name.h"
#include "exec/backend.h"

namespace strata {

// A queued command and where its chunk's x and out were at submission (set_device_io).
struct QueuedCommand {
  Command c;
  DeviceIo io;
};

// Item: what the queue holds, QueuedCommand or a struct with more (default-constructible, with
// QueuedCommand's members c and io).
template <class Item = QueuedCommand>
class QueuedBackend : public Backend {
 public:
  void bind(const DeviceBuffers& buffers) final {
    std::unique_lock<std::mutex> lk(mu_);
    drain_locked(lk);
    bind_idle(buffers);
  }

  void submit(const std::vector<Command>& commands) final {
    {
      std::lock_guard<std::mutex> lk(mu_);
      const std::size_t before = queue_.size();
      enqueue(commands, io_, queue_);
      queued_.fetch_add(queue_.size() - before, std::memory_order_release);
    }
    cv_.notify_all();
  }

  void synchronize() final {
    std::unique_lock<std::mutex> lk(mu_);
    drain_locked(lk);
  }

  void abort_pending() final {
    SharedEvent* parked = nullptr;
    std::uint64_t value = 0;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (flow_ == Flow::Run) flow_ = Flow::Skip;
      if (device_ == Device::Parked) {
        parked = parked_event_;
        value = parked_value_;
      }
    }
    // A device thread parked on a Wait must wake: its event gets the value it waits for.
    if (parked) parked->signal(value);
    cv_.notify_all();
  }

  std::string take_device_error() final {
    std::lock_guard<std::mutex> lk(mu_);
    std::string e;
    e.swap(error_);
    return e;
  }

 protected:
  // `idle_spin`: how long the device thread polls for a submission before it sleeps on the
  // condition variable (zero: it sleeps at once). A wake from a futex costs tens of
  // microseconds on a virtual machine; the spin costs one core at most that long.
  explicit QueuedBackend(const char* thread_name,
                         std::chrono::microseconds idle_spin = std::chrono::microseconds(0))
      : thread_name_(thread_name), idle_spin_(idle_spin) {}
  ~QueuedBackend() override { stop(); }

  // The derived constructor's last statement: every field the hooks touch exists.
  void start() {
    device_thread_ = std::thread([this] {
      name_this_thread(thread_name_);
      device_thread_started();
      device_loop();
    });
  }
  // The derived destructor's first statement: skips what is queued and joins the device thread.
  void stop() {
    if (!device_thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lk(mu_);
      flow_ = Flow::Stop;
    }
    cv_.notify_all();
    device_thread_.join();
  }

  // The hooks (above). bind_idle may throw: bind() rethrows, the backend unbound.
  virtual void bind_idle(const DeviceBuffers& buffers) = 0;
  virtual std::string execute(const Item& item) = 0;
  // One submission into the queue, mu_ held (the device thread takes nothing meanwhile, so
  // what this submission appended is still at the back). `io`: set_device_io's, as of now.
  virtual void enqueue(const std::vector<Command>& commands, const DeviceIo& io,
                       std::deque<Item>& queue) {
    for (const Command& c : commands) {
      Item item;
      item.c = c;
      item.io = io;
      queue.push_back(item);
    }
  }
  // First thing on the device thread (the CUDA host selects its device there).
  virtual void device_thread_started() {}
  // An item dropped after abort_pending() (device thread, mu_ held): forget what it began.
  virtual void skipped(const Item&) {}
  // synchronize() and bind(), once the queue is drained and the device thread idle, mu_ held:
  // what else a drain must wait for (a GPU stream) or report; returns an error or "".
  virtual std::string drained() { return ""; }

  std::chrono::microseconds idle_spin() const { return idle_spin_; }

  // set_device_io's store: the commands submitted from now on carry `io`.
  void store_device_io(const DeviceIo& io) {
    std::lock_guard<std::mutex> lk(mu_);
    io_ = io;
  }

 private:
  // What the host asks of the queue.
  enum class Flow : std::uint8_t {
    Run,   // execute commands in order
    Skip,  // abort_pending(): drop queued commands until the next drain
    Stop,  // stop(): drop everything and end the device thread
  };
  // What the device thread is doing.
  enum class Device : std::uint8_t {
    Idle,       // between commands (waiting, spinning or skipping)
    Executing,  // running a command other than Wait, outside the lock
    Parked,     // running a Wait: parked_event_ is its event, which abort_pending() raises
  };

  // Waits until the device thread is idle with nothing queued, ends a Skip, lets the backend
  // drain what lies beyond the queue, and latches its error.
  void drain_locked(std::unique_lock<std::mutex>& lk) {
    idle_cv_.wait(lk, [&] { return queue_.empty() && device_ == Device::Idle; });
    if (flow_ == Flow::Skip) flow_ = Flow::Run;
    latch_locked(drained());
  }

  void latch_locked(const std::string& err) {
    if (!err.empty() && error_.empty()) error_ = err;
  }

  void device_loop() {
    std::unique_lock<std::mutex> lk(mu_);
    std::uint64_t taken = 0;  // items this thread has taken off the queue
    for (;;) {
      if (queue_.empty() && flow_ != Flow::Stop && idle_spin_.count() > 0) spin(lk, taken);
      cv_.wait(lk, [&] { return flow_ == Flow::Stop || !queue_.empty(); });
      if (flow_ == Flow::Stop && queue_.empty()) return;
      Item item = queue_.front();
      queue_.pop_front();
      ++taken;
      if (flow_ != Flow::Run) {
        skipped(item);
      } else {
        run(lk, item);
      }
      if (queue_.empty()) idle_cv_.notify_all();
    }
  }

  // Polls the submission count, without the lock, for up to idle_spin_.
  void spin(std::unique_lock<std::mutex>& lk, std::uint64_t taken) {
    lk.unlock();
    const auto until = std::chrono::steady_clock::now() + idle_spin_;
    while (queued_.load(std::memory_order_acquire) == taken &&
           std::chrono::steady_clock::now() < until) {
    }
    lk.lock();
  }

  // One item through execute(), outside the lock; a throw is the item's error.
  void run(std::unique_lock<std::mutex>& lk, const Item& item) {
    const Command& c = item.c;
    if (c.op == Op::Wait) {
      device_ = Device::Parked;
      parked_event_ = c.event;
      parked_value_ = c.value;
    } else {
      device_ = Device::Executing;
    }
    lk.unlock();
    std::string err;
    try {
      err = execute(item);
    } catch (const std::exception& e) {
      err = e.what();
    }
    lk.lock();
    device_ = Device::Idle;
    parked_event_ = nullptr;
    latch_locked(err);
  }

  const char* const thread_name_;
  const std::chrono::microseconds idle_spin_;
  std::mutex mu_;
  std::condition_variable cv_;       // mu_: items queued, or Stop
  std::condition_variable idle_cv_;  // mu_: the queue drained
  std::deque<Item> queue_;           // mu_
  // Items ever queued (written under mu_, read by the spin without it).
  std::atomic<std::uint64_t> queued_{0};
  Flow flow_ = Flow::Run;                // mu_
  Device device_ = Device::Idle;         // mu_
  SharedEvent* parked_event_ = nullptr;  // mu_: set while device_ is Parked
  std::uint64_t parked_value_ = 0;       // mu_
  std::string error_;                    // mu_: the first error since take_device_error()
  DeviceIo io_;                          // mu_: set_device_io's, copied into each submission
  std::thread device_thread_;            // start() .. stop()
};

}  // namespace strata
