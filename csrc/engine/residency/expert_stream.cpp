#include "residency/expert_stream.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <new>
#include <optional>
#include <sstream>

#include "common/check.h"
#include "common/errors.h"
#include "common/thread_name.h"
#include "common/timing.h"
#include "pack/checksum.h"
#include "residency/fault_injection.h"
#include "residency/smap.h"
#include "residency/stream_testing.h"

namespace strata {

const char* to_string(ReadClass c) {
  switch (c) {
    case ReadClass::Urgent: return "urgent";
    case ReadClass::Pred1: return "pred1";
    case ReadClass::Pred2: return "pred2";
    case ReadClass::Profile: return "profile";
  }
  return "?";
}

void ExpertStream::SmapFree::operator()(std::uint32_t* p) const { std::free(p); }

std::uint64_t balanced_part_bytes(std::uint64_t span, std::uint64_t cap, std::uint32_t threads) {
  // A lone miss waits for the IO thread that reads the most of its record. Parts of `cap` can
  // leave that thread two full parts while others idle (2.5 MiB in 256 KiB parts over 8
  // threads: 10 parts, 512 KiB on two threads); parts of equal size, their count a multiple of
  // the threads, give each thread the same share. Not below kMinBalancedPart: a small record
  // is not worth more preads (each a syscall, and a VM exit under O_DIRECT on a VM).
  constexpr std::uint64_t kMinBalancedPart = 64 << 10;
  std::uint64_t n = (span + cap - 1) / cap;
  if (threads > 1) {
    const std::uint64_t balanced = (n + threads - 1) / threads * threads;
    n = std::max(n, std::min(balanced, span / kMinBalancedPart));
  }
  const std::uint64_t part = ((span + n - 1) / n + kPage - 1) / kPage * kPage;
  return std::min(part, cap);
}

ExpertStream::ExpertStream(const std::string& pack_path, const StreamOptions& options)
    : opt_(options), faults_(std::make_unique<FaultInjector>()) {
  if (opt_.part_bytes == 0 || opt_.part_bytes % kPage)
    throw EngineError(ErrorKind::Config, "part_bytes must be a positive multiple of " +
                                             std::to_string(kPage) + ", got " +
                                             std::to_string(opt_.part_bytes));
  if (!(opt_.io_timeout_s > 0))
    throw EngineError(ErrorKind::Config, "io_timeout_s must be positive");
  file_ = std::make_unique<PackFile>(pack_path, opt_.direct_io);
  const PackLayout& L = file_->layout();

  std::uint64_t stride = L.record_stride;
  std::uint64_t want = opt_.arena_bytes / stride;
  std::uint32_t need = min_slots(L);
  if (want < need) {
    std::ostringstream m;
    m << "arena_bytes " << opt_.arena_bytes << " holds " << want << " expert slots of " << stride
      << " bytes; at least " << need << " slots (" << need * stride
      << " bytes) are needed: one layer's top-" << L.top_k
      << " plus the next layer's, whose router may already be running";
    throw EngineError(ErrorKind::Config, m.str());
  }
  // More slots than experts would never be used.
  std::uint32_t n_slots = std::uint32_t(std::min<std::uint64_t>(want, L.n_keys()));
  arena_ = std::make_unique<Arena>(n_slots, stride);

  read_span_ = (L.record_bytes + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
  part_bytes_ = balanced_part_bytes(read_span_, opt_.part_bytes, opt_.io_threads);
  n_parts_ = std::uint32_t((read_span_ + part_bytes_ - 1) / part_bytes_);
  if (n_parts_ > 0xFFFF) throw EngineError(ErrorKind::Config, "part_bytes too small");

  // Page-aligned so a backend can wrap it without a copy.
  std::size_t smap_bytes = (std::size_t(L.n_keys()) * 4 + kPage - 1) / kPage * kPage;
  void* p = nullptr;
  if (posix_memalign(&p, kPage, smap_bytes) != 0) throw std::bad_alloc();
  smap_.reset(static_cast<std::uint32_t*>(p));
  std::fill_n(smap_.get(), smap_bytes / 4, kAbsent);

  slots_ = std::vector<Slot>(n_slots);
  if (opt_.verify_reads && !opt_.simulate_io) part_crc_.assign(std::size_t(n_slots) * n_parts_, 0);
  lru_ = LruList(n_slots);
  // One token routes n_layers * top_k experts: guard one token, decay over sixteen. An arena
  // of fewer slots than one token's uses cannot keep a key until the next token, and there a
  // one-token guard would cover every resident key, so heat would never rank and the policy
  // would be LRU, which the layer-by-layer sweep defeats entirely (hit rate 0 on the Qwen3
  // trace below 288 slots). So no guard there: I4 still protects the executing and next layer.
  const double token = double(L.n_layers) * L.top_k;
  const std::uint64_t guard = n_slots >= token ? std::uint64_t(token) : 0;
  heat_ = KeyHeat(L.n_keys(), L.n_experts, 16 * token, guard);
  heat_order_ = HeatOrder(n_slots);
  where_.assign(L.n_keys(), -1);
  free_.reserve(n_slots);
  for (std::uint32_t s = n_slots; s-- > 0;) free_.push_back(s);  // slot 0 handed out first

  clients_[kStreamClient] = ProtectionSet{};
  Lock lk(mu_);  // the threads start under mu_, so they see live_io_ counted
  threads_.reserve(opt_.io_threads);
  for (std::uint32_t i = 0; i < opt_.io_threads; ++i) {
    threads_.emplace_back([this] {
      name_this_thread("strata-io");
      io_loop();
      io_exited();
    });
    ++live_io_;
  }
}

// Waits for every IO thread however long a stuck read takes: they write into arena_ and take
// mu_, so nothing may be freed before they return. dispose() is the non-blocking way out.
ExpertStream::~ExpertStream() { close(); }

bool ExpertStream::close(double bound_s) {
  {
    // Clients first, each while its IO still runs: a Window's layer in flight finishes (or fails
    // on its own bounds), then the Window fails its turn with Closed and frees its device.
    std::lock_guard<std::mutex> hooks(clients_mu_);
    {
      std::lock_guard<std::mutex> lk(mu_);
      closing_clients_ = true;
    }
    done_cv_.notify_all();
    for (auto& [id, on_close] : closers_) on_close();
    std::lock_guard<std::mutex> lk(mu_);
    closing_ = true;  // under clients_mu_ too: no client registers after its hook ran
  }
  faults_->open_gate();  // a read held by a test's Gate fault must not hold up the join
  io_cv_.notify_all();
  done_cv_.notify_all();
  Lock lk(mu_);
  auto exited = [this] { return live_io_ == 0; };
  if (!(bound_s < 1e6))  // a million seconds is forever (and keeps the clock from overflowing)
    exit_cv_.wait(lk, exited);
  else if (!exit_cv_.wait_for(lk, std::chrono::duration<double>(std::max(0.0, bound_s)), exited))
    return false;  // still reading: threads_ stays, joined by a later close or the destructor
  // Every thread has returned from its function: joining is immediate. Moved out under mu_ so
  // that two closers never join the same thread.
  std::vector<std::thread> done;
  done.swap(threads_);
  lk.unlock();
  for (auto& t : done) t.join();
  return true;
}

bool ExpertStream::closed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return closing_;
}

std::string ExpertStream::describe_in_flight() const {
  std::lock_guard<std::mutex> lk(mu_);
  const std::uint32_t E = layout().n_experts;
  std::ostringstream m;
  for (const Slot& sl : slots_)
    if (sl.in_flight() && sl.key != kNoKey)
      m << (m.tellp() > 0 ? ", " : "") << "layer " << sl.key / E << " expert " << sl.key % E
        << " (" << sl.parts_started - sl.parts_done << " part(s))";
  return m.str();
}

void ExpertStream::require_open() const {
  if (closing_) throw EngineError(ErrorKind::Closed, "ExpertStream is closed");
}

void ExpertStream::check_layer(std::uint32_t layer) const {
  if (layer >= layout().n_layers)
    throw std::out_of_range("layer " + std::to_string(layer) + " out of range [0, " +
                            std::to_string(layout().n_layers) + ")");
}

void ExpertStream::check_experts(std::uint32_t layer, const std::int32_t* experts,
                                 std::size_t n) const {
  check_layer(layer);
  const std::uint32_t E = layout().n_experts;
  for (std::size_t i = 0; i < n; ++i)
    if (experts[i] < 0 || std::uint32_t(experts[i]) >= E)
      throw std::out_of_range("expert " + std::to_string(experts[i]) + " out of range [0, " +
                              std::to_string(E) + ")");
}

// ---- views -------------------------------------------------------------------------------------

std::uint32_t ExpertStream::smap_at(std::uint32_t key) const {
  if (key >= layout().n_keys()) throw std::out_of_range("key out of range");
  return smap_load(smap_.get(), key);
}

std::uint32_t ExpertStream::key(std::int64_t layer, std::int64_t expert) const {
  const PackLayout& L = layout();  // immutable: no lock needed
  if (layer < 0 || layer >= std::int64_t(L.n_layers))
    throw EngineError(ErrorKind::Config, "layer " + std::to_string(layer) + " out of range [0, " +
                                             std::to_string(L.n_layers) + ")");
  if (expert < 0 || expert >= std::int64_t(L.n_experts))
    throw EngineError(ErrorKind::Config, "expert " + std::to_string(expert) +
                                             " out of range [0, " + std::to_string(L.n_experts) +
                                             ")");
  return std::uint32_t(layer) * L.n_experts + std::uint32_t(expert);
}

std::int32_t ExpertStream::where(std::int64_t layer, std::int64_t expert) const {
  const std::uint32_t k = key(layer, expert);
  std::lock_guard<std::mutex> lk(mu_);
  return where_[k];
}

std::vector<SlotInfo> ExpertStream::slots() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<SlotInfo> out;
  out.reserve(slots_.size());
  for (std::uint32_t s = 0; s < slots_.size(); ++s) {
    const Slot& sl = slots_[s];
    out.push_back(SlotInfo{s, sl.key, sl.load(), sl.cls, sl.parts_total, sl.parts_started,
                           sl.parts_done, sl.published, sl.failed_part, sl.pins, sl.last_use});
  }
  return out;
}

}  // namespace strata
