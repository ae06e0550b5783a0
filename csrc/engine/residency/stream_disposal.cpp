// ExpertStream::dispose: destroying a stream whose IO thread is stuck in a read, off the caller's thread.
#include "residency/expert_stream.h"

#include <atomic>
#include <thread>

#include "common/thread_name.h"

namespace strata {

namespace {
std::atomic<std::size_t> g_disposing{0};
}

void ExpertStream::dispose(std::unique_ptr<ExpertStream> stream, double bound_s) {
  if (!stream) return;
  if (stream->close(bound_s)) return;  // joined: the unique_ptr frees it here
  g_disposing.fetch_add(1);
  std::thread([s = std::move(stream)]() mutable {
    name_this_thread("strata-dispose");
    s.reset();  // the destructor waits for the stuck read, then frees the arena
    g_disposing.fetch_sub(1);
  }).detach();
}

std::size_t ExpertStream::disposing() { return g_disposing.load(); }

}  // namespace strata
