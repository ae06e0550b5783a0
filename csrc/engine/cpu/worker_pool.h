// Persistent workers for the CPU backend's ParallelFor: one fork-join per kernel stage.
//
// The caller works too, and a join waits only for the chunks that were handed out, never for a
// worker to check in: on a machine whose cores are all busy (a server's event loop, its
// clients, other processes), a worker the scheduler has not run yet would otherwise hold every
// join until it got a core, which on two cores cost a decode step more than the parallel work
// saved. A worker that wakes after its run was joined takes nothing from it; the next run is
// what it joins.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "common/check.h"
#include "common/thread_name.h"

namespace strata::cpu {

class WorkerPool {
 public:
  using Job = std::function<void(std::uint32_t, std::uint32_t)>;

  explicit WorkerPool(unsigned workers) {
    for (unsigned i = 0; i < workers; ++i) threads_.emplace_back([this] {
        name_this_thread("strata-pool");
        loop();
      });
  }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  ~WorkerPool() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  unsigned workers() const { return unsigned(threads_.size()); }

  // Runs fn over [0, n) in chunks, on the caller and whichever workers get a core in time;
  // returns when every chunk ran. One caller at a time (the backend's device thread).
  void run(std::uint32_t n, const Job& fn) {
    if (n == 0) return;
    const std::uint32_t parts = std::uint32_t(threads_.size()) + 1;
    const std::uint32_t chunk = (n + parts * 4 - 1) / (parts * 4);
    if (threads_.empty() || n <= chunk) {
      fn(0, n);
      return;
    }
    const std::uint32_t chunks = (n + chunk - 1) / chunk;
    {
      std::lock_guard<std::mutex> lk(mu_);
      STRATA_ASSERT(state_ == State::Idle && active_ == 0, "one run of a worker pool at a time");
      job_ = &fn;
      n_ = n;
      chunk_ = chunk;
      next_.store(0, std::memory_order_relaxed);
      done_.store(0, std::memory_order_relaxed);
      state_ = State::Open;  // Idle -> Open: workers may join
      ++epoch_;
    }
    cv_.notify_all();
    work();
    // The chunks handed out, whoever runs them.
    std::unique_lock<std::mutex> lk(mu_);
    done_cv_.wait(lk, [&] { return done_.load(std::memory_order_acquire) >= chunks; });
    // Open -> Closing: no worker joins now; those inside work() find no chunk left and leave.
    state_ = State::Closing;
    done_cv_.wait(lk, [&] { return active_ == 0; });
    state_ = State::Idle;  // Closing -> Idle: fn may go
    job_ = nullptr;
  }

 private:
  enum class State : std::uint8_t { Idle, Open, Closing };

  void work() {
    for (;;) {
      const std::uint32_t start = next_.fetch_add(chunk_, std::memory_order_relaxed);
      if (start >= n_) return;
      (*job_)(start, std::min(n_, start + chunk_));
      if (done_.fetch_add(1, std::memory_order_acq_rel) + 1 == (n_ + chunk_ - 1) / chunk_) {
        std::lock_guard<std::mutex> lk(mu_);  // the caller checks done_ under mu_: no lost wake
        done_cv_.notify_all();
      }
    }
  }
  void loop() {
    std::uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      // A run that is already closing (or over) when this worker gets a core is skipped.
      cv_.wait(lk, [&] { return stop_ || (state_ == State::Open && epoch_ != seen); });
      if (stop_) return;
      seen = epoch_;
      ++active_;
      lk.unlock();
      work();
      lk.lock();
      if (--active_ == 0 && state_ == State::Closing) done_cv_.notify_all();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  // The run's job: written under mu_ while Idle, read by the caller and by workers that joined
  // (active_) while Open or Closing; it stays valid until state_ is Idle again.
  const Job* job_ = nullptr;
  std::uint32_t n_ = 0, chunk_ = 1;     // as job_
  std::atomic<std::uint32_t> next_{0};  // the next chunk's start: hands chunks out
  std::atomic<std::uint32_t> done_{0};  // chunks finished in this run
  State state_ = State::Idle;           // mu_
  std::uint32_t active_ = 0;            // mu_: workers inside work() for this run
  std::uint64_t epoch_ = 0;             // mu_: runs started
  bool stop_ = false;                   // mu_
};

}  // namespace strata::cpu
