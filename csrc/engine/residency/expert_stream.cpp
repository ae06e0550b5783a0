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
#include "residency/smap.h"

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

ExpertStream::ExpertStream(const std::string& pack_path, const StreamOptions& options)
    : opt_(options) {
  if (opt_.part_bytes == 0 || opt_.part_bytes % kPage)
    throw EngineError(ErrorKind::Config, "part_bytes must be a positive multiple of 16384, got " +
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
  n_parts_ = std::uint32_t((read_span_ + opt_.part_bytes - 1) / opt_.part_bytes);
  if (n_parts_ > 0xFFFF) throw EngineError(ErrorKind::Config, "part_bytes too small");

  // Page-aligned so a backend can wrap it without a copy.
  std::size_t smap_bytes = (std::size_t(L.n_keys()) * 4 + kPage - 1) / kPage * kPage;
  void* p = nullptr;
  if (posix_memalign(&p, kPage, smap_bytes) != 0) throw std::bad_alloc();
  smap_.reset(static_cast<std::uint32_t*>(p));
  std::fill_n(smap_.get(), smap_bytes / 4, kAbsent);

  slots_ = std::vector<Slot>(n_slots);
  lru_ = LruList(n_slots);
  // One token routes n_layers * top_k experts: guard one token, decay over sixteen. An arena
  // of fewer slots than one token's uses cannot keep a key until the next token, and there a
  // one-token guard would cover every resident key, so heat would never rank and the policy
  // would be LRU, which the layer-by-layer sweep defeats entirely (hit rate 0 on the Qwen3
  // trace below 288 slots). So no guard there: I4 still protects the executing and next layer.
  const double token = double(L.n_layers) * L.top_k;
  const std::uint64_t guard = n_slots >= token ? std::uint64_t(token) : 0;
  heat_ = KeyHeat(L.n_keys(), 16 * token, guard);
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

void ExpertStream::io_exited() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    --live_io_;
  }
  exit_cv_.notify_all();
}

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
  faults_.open_gate();  // a read held by a test's Gate fault must not hold up the join
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

// ---- clients ------------------------------------------------------------------------------------

ClientId ExpertStream::open_client(std::function<void()> on_close) {
  std::lock_guard<std::mutex> hooks(clients_mu_);
  std::lock_guard<std::mutex> lk(mu_);
  require_open();
  const ClientId id{next_client_++};
  clients_[id] = ProtectionSet{};
  closers_[id] = std::move(on_close);
  return id;
}

void ExpertStream::release_client(ClientId who) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = clients_.find(who);
    if (it == clients_.end()) return;
    release_plan_locked(it->second);
    it->second.executing = -1;
    it->second.next = -1;
  }
  done_cv_.notify_all();  // a request waiting for space may find some now
}

void ExpertStream::close_client(ClientId who) {
  STRATA_ASSERT(who != kStreamClient, "the stream's own protections are never unregistered");
  release_client(who);
  std::lock_guard<std::mutex> hooks(clients_mu_);
  closers_.erase(who);
  std::lock_guard<std::mutex> lk(mu_);
  clients_.erase(who);
}

std::size_t ExpertStream::n_clients() const {
  std::lock_guard<std::mutex> lk(mu_);
  return clients_.size() - 1;
}

std::size_t ExpertStream::clients_waiting_for_space() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::size_t n = 0;
  for (const auto& [id, p] : clients_) n += p.waiting_for_space;
  return n;
}

ProtectionSet& ExpertStream::client_locked(ClientId who) {
  auto it = clients_.find(who);
  if (it == clients_.end())
    throw EngineError(ErrorKind::Closed, "stream client " + std::to_string(std::uint32_t(who)) +
                                             " is not registered (its Window was closed)");
  return it->second;
}

bool ExpertStream::another_client_may_release(ClientId who) const {
  for (const auto& [id, p] : clients_)
    if (id != who && p.holds_any() && !p.waiting_for_space) return true;
  return false;
}

void ExpertStream::require_open() const {
  if (closing_) throw EngineError(ErrorKind::Closed, "ExpertStream is closed");
}

void ExpertStream::check_layer(std::uint32_t layer) const {
  if (layer >= layout().n_layers)
    throw std::out_of_range("layer " + std::to_string(layer) + " out of range [0, " +
                            std::to_string(layout().n_layers) + ")");
}

// ---- slot transitions (all under mu_) ------------------------------------------------------

void ExpertStream::assign(std::uint32_t s, std::uint32_t key, ReadClass cls) {
  Slot& sl = slots_[s];
  STRATA_ASSERT(sl.load() == SlotState::Free && sl.key == kNoKey, "assign takes a free slot");
  STRATA_ASSERT(where_[key] < 0, "a key lives in at most one slot");
  sl.key = key;
  sl.cls = cls;
  sl.parts_total = std::uint16_t(n_parts_);
  sl.parts_started = sl.parts_done = 0;
  sl.failed_part = sl.published = false;
  sl.used = cls == ReadClass::Urgent;
  sl.err = 0;
  sl.err_offset = 0;
  sl.unread.clear();
  touch(s);
  sl.state.store(SlotState::Queued, std::memory_order_release);
  where_[key] = std::int32_t(s);
  enqueue_parts(s);
}

void ExpertStream::enqueue_parts(std::uint32_t s) {
  Slot& sl = slots_[s];
  for (std::uint16_t p = sl.parts_started; p < sl.parts_total; ++p)
    queue_.push(IoJob{s, sl.gen, p, sl.cls});
  wake_io_.store(true, std::memory_order_relaxed);  // woken once, after the caller drops mu_
}

void ExpertStream::wake_io() {
  // One wake-up from the host; each IO thread that takes a job wakes the next while work
  // remains (io_loop), so the cost of waking the pool lands on the IO threads, not the handshake.
  if (wake_io_.exchange(false)) io_cv_.notify_one();
}

void ExpertStream::touch(std::uint32_t s) {
  slots_[s].last_use = ++clock_;
  lru_.touch(s);
  heat_order_.touched(s);
}

void ExpertStream::publish_slot(std::uint32_t s) {
  Slot& sl = slots_[s];
  STRATA_ASSERT(sl.load() == SlotState::Complete, "I1: only complete slots are published");
  STRATA_ASSERT(where_[sl.key] == std::int32_t(s), "I1: published slot holds its key");
  if (sl.published) return;
  smap_store(smap_.get(), sl.key, s);
  sl.published = true;
}

void ExpertStream::unpublish(std::uint32_t s) {
  Slot& sl = slots_[s];
  if (!sl.published) return;
  smap_store(smap_.get(), sl.key, kAbsent);
  sl.published = false;
}

// I5: the maps forget the key before the slot's bytes can be reused.
void ExpertStream::recycle(std::uint32_t s) {
  Slot& sl = slots_[s];
  STRATA_ASSERT(!sl.in_flight(), "I7: never recycle a slot with a read in flight");
  STRATA_ASSERT(sl.pins == 0, "I8: never recycle a plan-resident slot");
  if (sl.load() == SlotState::Limbo) limbo_.erase(std::find(limbo_.begin(), limbo_.end(), s));
  if (sl.load() == SlotState::Queued || sl.load() == SlotState::Limbo) queue_.drop_slot(s);
  lru_.remove(s);
  heat_order_.removed(s);
  if (sl.key != kNoKey) {
    unpublish(s);
    where_[sl.key] = -1;
  }
  sl.key = kNoKey;
  ++sl.gen;
  sl.unread.clear();
  sl.parts_total = sl.parts_started = sl.parts_done = 0;
  sl.failed_part = sl.published = sl.used = false;
  sl.state.store(SlotState::Free, std::memory_order_release);
  free_.push_back(s);
}

// I7: an unchosen speculative slot leaves the device's view and waits for its reads to finish.
void ExpertStream::park(std::uint32_t s) {
  Slot& sl = slots_[s];
  SlotState st = sl.load();
  STRATA_ASSERT(st == SlotState::Queued || st == SlotState::Reading || st == SlotState::Complete,
                "park takes queued, reading or complete slots");
  if (st == SlotState::Queued) {
    // No part has begun: drop its jobs now; revive() re-queues them if the expert returns.
    queue_.drop_slot(s);
    sl.parts_total = std::uint16_t(n_parts_);
    sl.parts_started = sl.parts_done = 0;
    ++sl.gen;
  } else if (st == SlotState::Reading) {
    // Nobody chose this expert: the parts that have not begun are not read (they would only take
    // the SSD from work someone needs). Those in flight finish; release_limbo waits for them (I7).
    queue_.drop_slot(s, &sl.unread);
  }
  unpublish(s);
  sl.state.store(SlotState::Limbo, std::memory_order_release);
  limbo_.push_back(s);
  stats_.limbo.fetch_add(1, std::memory_order_relaxed);
}

void ExpertStream::revive(std::uint32_t s, ReadClass cls) {
  Slot& sl = slots_[s];
  STRATA_ASSERT(sl.load() == SlotState::Limbo, "revive takes a limbo slot");
  limbo_.erase(std::find(limbo_.begin(), limbo_.end(), s));
  sl.cls = cls;
  stats_.revived.fetch_add(1, std::memory_order_relaxed);
  if (sl.parts_started == 0) {
    sl.state.store(SlotState::Queued, std::memory_order_release);
    enqueue_parts(s);
  } else if (!sl.unread.empty()) {
    // Parked while reading: queue the parts park() took back, as the class now asking.
    sl.state.store(SlotState::Reading, std::memory_order_release);
    if (cls == ReadClass::Urgent) queue_.promote(s, cls);
    for (std::uint16_t p : sl.unread) queue_.push(IoJob{s, sl.gen, p, cls});
    sl.unread.clear();
    wake_io_.store(true, std::memory_order_relaxed);
  } else if (!sl.reads_finished()) {
    sl.state.store(SlotState::Reading, std::memory_order_release);
    if (cls == ReadClass::Urgent) queue_.promote(s, cls);
  } else if (sl.failed_part) {
    sl.state.store(SlotState::Failed, std::memory_order_release);
  } else {
    sl.state.store(SlotState::Complete, std::memory_order_release);
  }
}

void ExpertStream::make_urgent(std::uint32_t s) {
  Slot& sl = slots_[s];
  if (sl.cls != ReadClass::Urgent) {
    sl.cls = ReadClass::Urgent;
    queue_.promote(s, ReadClass::Urgent);
  }
  if (!sl.used) {
    sl.used = true;
    stats_.spec_hits.fetch_add(1, std::memory_order_relaxed);
  }
}

// ---- protections and victims -----------------------------------------------------------------

// The union over every client: one Window's victim never comes out of another's protections.
bool ExpertStream::is_protected(std::uint32_t key, bool speculative) const {
  const std::int64_t layer = key / layout().n_experts;
  const std::uint32_t expert = key % layout().n_experts;
  for (const auto& [id, p] : clients_) {
    if (p.executing < 0 && p.next < 0) continue;
    if (layer == p.executing && p.executing_keep[expert]) return true;  // I4
    if (layer == p.next) return true;                                   // I4: next router
    // I9: speculation never evicts the current or the next layer.
    if (speculative && p.executing >= 0 && (layer == p.executing || layer == p.executing + 1))
      return true;
  }
  return false;
}

bool ExpertStream::evictable(std::uint32_t s, bool speculative) const {
  const Slot& sl = slots_[s];
  SlotState st = sl.load();
  if (st != SlotState::Complete && st != SlotState::Failed) return false;
  if (sl.in_flight() || sl.pins) return false;  // I4: reads in flight, plan-resident (I8)
  return !is_protected(sl.key, speculative);
}

std::int32_t ExpertStream::pick_victim(bool speculative) const {
  if (opt_.eviction == EvictionPolicy::DecayedLfu) return pick_coldest_heat(speculative);
  for (std::uint32_t s = lru_.coldest(); s != LruList::kNone; s = lru_.warmer(s))
    if (evictable(s, speculative)) return std::int32_t(s);
  return -1;
}

// The unguarded evictable slot of least heat, else (every candidate guarded) the least recently
// touched one.
std::int32_t ExpertStream::pick_coldest_heat(bool speculative) const {
  heat_order_.settle(heat_, [this](std::uint32_t s) { return slots_[s].key; });
  std::uint32_t s = heat_order_.first([&](std::uint32_t c) { return evictable(c, speculative); });
  return s == LruList::kNone ? -1 : std::int32_t(s);
}

std::int32_t ExpertStream::pick_queued_speculative() const {
  for (std::uint32_t s = lru_.coldest(); s != LruList::kNone; s = lru_.warmer(s)) {
    const Slot& sl = slots_[s];
    if (sl.load() != SlotState::Queued || sl.cls == ReadClass::Urgent) continue;
    if (is_protected(sl.key, false)) continue;
    return std::int32_t(s);
  }
  return -1;
}

// A slot for a new read: free, then finished limbo, then the LRU victim, then (urgent only) a
// queued speculative read cancelled so urgent work never waits behind speculation.
std::int32_t ExpertStream::take_slot(bool speculative) {
  if (free_.empty()) {
    for (std::uint32_t s : limbo_) {
      const Slot& sl = slots_[s];
      if (sl.limbo_releasable()) {
        recycle(s);
        stats_.limbo_released.fetch_add(1, std::memory_order_relaxed);
        break;
      }
    }
  }
  if (free_.empty()) {
    std::int32_t v = pick_victim(speculative);
    if (v >= 0) {
      recycle(std::uint32_t(v));
      stats_.evicted.fetch_add(1, std::memory_order_relaxed);
    } else if (!speculative) {
      std::int32_t q = pick_queued_speculative();
      if (q >= 0) {
        recycle(std::uint32_t(q));
        stats_.cancelled.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }
  if (free_.empty()) return -1;
  std::uint32_t s = free_.back();
  free_.pop_back();
  return std::int32_t(s);
}

std::string ExpertStream::describe_full(ClientId who) const {
  std::ostringstream m;
  std::uint32_t counts[6] = {};
  for (const auto& sl : slots_) ++counts[int(sl.load())];
  m << "no arena slot available for an urgent read: " << slots_.size() << " slots, "
    << counts[int(SlotState::Complete)] << " complete but protected ";
  bool others = false;
  for (const auto& [id, p] : clients_) {
    if (!p.holds_any()) continue;
    m << "[" << (id == who ? "by this caller" : "by another window (client " + std::to_string(std::uint32_t(id)) + ")")
      << ": executing layer " << p.executing << ", next-router layer " << p.next << ", "
      << p.pinned.size() << " plan-pinned" << (p.waiting_for_space ? ", itself waiting" : "")
      << "] ";
    others = others || id != who;
  }
  m << counts[int(SlotState::Queued)] + counts[int(SlotState::Reading)] << " loading, "
    << counts[int(SlotState::Limbo)] << " in limbo; ";
  if (others)
    m << "the windows sharing this stream protect more experts together than the arena holds: "
      << "a larger arena, fewer windows or fewer experts per call is needed";
  else
    m << "a larger arena or fewer experts per call is needed";
  m << " (minimum " << min_slots(layout()) << " slots per top-k call per window)";
  return m.str();
}

// ---- requests ----------------------------------------------------------------------------

RequestResult ExpertStream::request(ClientId who, std::uint32_t layer,
                                    const std::int32_t* experts, std::size_t n, ReadClass cls,
                                    const InterruptCheck& interrupt, std::uint32_t max_new) {
  IoWaker waker{this};
  Lock lk(mu_);
  require_open();
  return request_locked(lk, who, layer, experts, n, cls, interrupt, max_new);
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

RequestResult ExpertStream::request_locked(Lock& lk, ClientId who, std::uint32_t layer,
                                           const std::int32_t* experts, std::size_t n,
                                           ReadClass cls, const InterruptCheck& interrupt,
                                           std::uint32_t max_new) {
  check_experts(layer, experts, n);
  client_locked(who);  // registered (a closed Window's client is not)
  // Clears this client's waiting flag on every way out of the space wait below.
  // (An interrupt may throw while mu_ is released: the flag is cleared under mu_ regardless.)
  struct WaitingForSpace {
    ExpertStream* self;
    Lock& lk;
    ClientId who;
    bool on = false;
    void set(bool v) {  // under mu_
      auto it = self->clients_.find(who);
      if (it != self->clients_.end()) it->second.waiting_for_space = v;
      on = v;
    }
    ~WaitingForSpace() {
      if (!on) return;
      const bool held = lk.owns_lock();
      if (!held) lk.lock();
      set(false);
      if (!held) lk.unlock();
    }
  } waiting{this, lk, who};
  const std::uint32_t E = layout().n_experts;
  const bool speculative = cls != ReadClass::Urgent;
  RequestResult r;
  // An urgent request never evicts an expert it already holds in this call (a later expert
  // could otherwise pick an earlier, unprotected one as its victim): each resident slot it
  // touches is pinned, as a plan pins (I8), until the request returns on any path.
  struct CallPins {
    ExpertStream& self;
    Lock& lk;
    std::vector<std::uint32_t> slots;
    ~CallPins() {
      if (slots.empty()) return;
      if (!lk.owns_lock()) lk.lock();  // an interrupt throws with mu_ released
      for (std::uint32_t s : slots) --self.slots_[s].pins;
    }
  } call_pins{*this, lk, {}};
  std::optional<ReadProgress> progress;  // from the first wait for a slot
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t key = layer * E + std::uint32_t(experts[i]);
    if (speculative)
      heat_.on_predicted(key);
    else
      heat_.on_use(key);
    for (;;) {
      std::int32_t s = where_[key];
      if (s >= 0) {
        Slot& sl = slots_[std::uint32_t(s)];
        if (sl.load() == SlotState::Limbo) revive(std::uint32_t(s), cls);
        if (sl.load() == SlotState::Failed && !speculative) {
          recycle(std::uint32_t(s));  // retry a failed read rather than report it twice
        } else {
          touch(std::uint32_t(s));
          if (!speculative) {
            ++sl.pins;
            call_pins.slots.push_back(std::uint32_t(s));
            make_urgent(std::uint32_t(s));
            // A speculative read that completed before this handshake: publish it now.
            if (sl.load() == SlotState::Complete) publish_slot(std::uint32_t(s));
            ++r.hits;
          }
          break;
        }
      }
      if (r.misses + r.spec_started >= max_new) {  // the cap counts new reads only
        i = n;
        break;
      }
      std::int32_t slot = take_slot(speculative);
      if (slot >= 0) {
        if (waiting.on) waiting.set(false);
        assign(std::uint32_t(slot), key, cls);
        if (speculative) {
          ++r.spec_started;
          stats_.spec_requests.fetch_add(1, std::memory_order_relaxed);
        } else {
          ++r.misses;
        }
        break;
      }
      if (speculative) {  // I9: no space, so prediction stops here
        r.dropped = std::uint32_t(n - i);
        stats_.spec_dropped.fetch_add(n - i, std::memory_order_relaxed);
        i = n;
        break;
      }
      // Urgent and every slot busy: wait for a read in flight to land, or for another client
      // (a Window on another thread) to move past the protections that hold the arena.
      bool something_moves = false;
      for (const auto& sl : slots_) {
        SlotState st = sl.load();
        if (sl.in_flight() || st == SlotState::Queued || st == SlotState::Reading) {
          something_moves = true;
          break;
        }
      }
      if (closing_clients_ && !something_moves)
        throw EngineError(ErrorKind::Closed, "the ExpertStream is closing: no Window will release "
                                             "a slot for this read");
      const bool others_may_release = another_client_may_release(who);
      if ((!something_moves || threads_.empty()) && !others_may_release)
        throw EngineError(ErrorKind::ArenaFull, describe_full(who));
      if (!progress) progress = read_progress();
      waiting.set(true);
      lk.unlock();
      wake_io();
      lk.lock();
      // One rule for every bounded wait: io_timeout_s without read progress. Another Window
      // releasing a slot wakes this wait (done_cv_) and the loop takes the slot; one that holds
      // its protections that long without any read landing is named in the ArenaFull error.
      if (!await_part(lk, *progress)) {
        if (!something_moves)
          throw EngineError(ErrorKind::ArenaFull,
                            "waited " + std::to_string(opt_.io_timeout_s) +
                                " s (io_timeout_s) with no read progress for another window to "
                                "release a slot; " + describe_full(who));
        throw EngineError(ErrorKind::Timeout,
                          "timed out after " + std::to_string(opt_.io_timeout_s) +
                              " s with no read progress waiting for a free arena slot for layer " +
                              std::to_string(layer) + " expert " + std::to_string(experts[i]));
      }
      if (interrupt) {
        lk.unlock();
        interrupt();
        lk.lock();
      }
      require_open();
    }
  }
  if (!speculative) {
    stats_.hits.fetch_add(r.hits, std::memory_order_relaxed);
    stats_.misses.fetch_add(r.misses, std::memory_order_relaxed);
  }
  return r;
}

void ExpertStream::throw_read_error(std::uint32_t s) {
  Slot& sl = slots_[s];
  const std::uint32_t E = layout().n_experts;
  std::uint32_t layer = sl.key / E, expert = sl.key % E;
  int err = sl.err;
  std::uint64_t off = sl.err_offset;
  std::ostringstream m;
  m << "expert read failed: layer " << layer << " expert " << expert << " at file offset " << off
    << " of " << file_->path() << ": ";
  if (err > 0)
    m << std::strerror(err) << " (errno " << err << ")";
  else if (err == kChecksumMismatch)
    m << "checksum mismatch: the record read fails its CRC32C (the file changed on disk or is "
         "corrupt) (errno 0)";
  else
    m << "short read (errno 0)";
  recycle(s);
  stats_.failed.fetch_add(1, std::memory_order_relaxed);
  throw ExpertReadError(m.str(), int(layer), int(expert), off, err > 0 ? err : 0);
}

ExpertStream::ReadProgress ExpertStream::read_progress() const {
  return ReadProgress{Clock::now(), stats_.bytes_read.load(std::memory_order_relaxed)};
}

bool ExpertStream::await_part(Lock& lk, ReadProgress& p) {
  done_cv_.wait_for(lk, std::chrono::milliseconds(50));
  const std::uint64_t now_done = stats_.bytes_read.load(std::memory_order_relaxed);
  if (now_done != p.bytes_read) {
    p.bytes_read = now_done;
    p.at = Clock::now();
    return true;
  }
  return Clock::now() - p.at <= std::chrono::duration<double>(opt_.io_timeout_s);
}

void ExpertStream::wait(ClientId who, std::uint32_t layer, const std::int32_t* experts,
                        std::size_t n, const InterruptCheck& interrupt) {
  check_experts(layer, experts, n);
  const std::uint32_t E = layout().n_experts;
  {
    // Anything not yet requested (or dropped) is requested now.
    std::vector<std::int32_t> missing;
    {
      std::lock_guard<std::mutex> lk(mu_);
      require_open();
      for (std::size_t i = 0; i < n; ++i) {
        std::int32_t s = where_[layer * E + std::uint32_t(experts[i])];
        if (s < 0 || slots_[std::uint32_t(s)].cls != ReadClass::Urgent ||
            slots_[std::uint32_t(s)].load() == SlotState::Limbo)
          missing.push_back(experts[i]);
      }
    }
    if (!missing.empty())
      request(who, layer, missing.data(), missing.size(), ReadClass::Urgent, interrupt);
  }
  Lock lk(mu_);
  auto t0 = Clock::now();
  ReadProgress progress = read_progress();
  bool blocked = false;
  for (;;) {
    require_open();
    bool all = true;
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t key = layer * E + std::uint32_t(experts[i]);
      std::int32_t s = where_[key];
      if (s < 0) {  // recycled under us (another caller's urgent request): re-request
        lk.unlock();
        request(who, layer, &experts[i], 1, ReadClass::Urgent, interrupt);
        lk.lock();
        all = false;
        break;
      }
      SlotState st = slots_[std::uint32_t(s)].load();
      if (st == SlotState::Failed && !slots_[std::uint32_t(s)].in_flight()) {
        if (blocked) stats_.stall_ns.fetch_add(ns_since(t0), std::memory_order_relaxed);
        throw_read_error(std::uint32_t(s));
      }
      if (st != SlotState::Complete) {
        all = false;
        if (threads_.empty()) {
          bool ran = false;
          // Manual IO: run this slot's next pending part inline, in queue order.
          auto jobs = queue_.snapshot();
          for (std::size_t j = 0; j < jobs.size(); ++j)
            if (jobs[j].slot == std::uint32_t(s)) {
              IoJob job = queue_.take(j);
              execute_job(lk, job);
              ran = true;
              break;
            }
          if (!ran)
            throw EngineError(ErrorKind::Timeout, "manual IO: slot " + std::to_string(s) +
                                                      " is loading but has no pending read");
        }
        break;
      }
      STRATA_ASSERT(slots_[std::uint32_t(s)].published, "I1: waited-for urgent slot published");
    }
    if (all) break;
    if (threads_.empty()) continue;
    blocked = true;
    if (!await_part(lk, progress)) {
      stats_.stall_ns.fetch_add(ns_since(t0), std::memory_order_relaxed);
      throw EngineError(ErrorKind::Timeout,
                        "timed out after " + std::to_string(opt_.io_timeout_s) +
                            " s with no read progress waiting for layer " + std::to_string(layer));
    }
    if (interrupt) {
      lk.unlock();
      try {
        interrupt();
      } catch (...) {
        stats_.stall_ns.fetch_add(ns_since(t0), std::memory_order_relaxed);
        throw;
      }
      lk.lock();
    }
  }
  if (blocked) stats_.stall_ns.fetch_add(ns_since(t0), std::memory_order_relaxed);
}

void ExpertStream::settle(const InterruptCheck& interrupt) {
  Lock lk(mu_);
  auto idle = [&] {
    if (!queue_.empty()) return false;
    for (const Slot& sl : slots_)
      if (sl.in_flight()) return false;
    return true;
  };
  ReadProgress progress = read_progress();
  for (;;) {
    require_open();
    if (threads_.empty()) {  // manual IO: run what is queued inline, in queue order
      while (!queue_.empty()) execute_job(lk, queue_.take(0));
      return;
    }
    if (idle()) return;
    if (!await_part(lk, progress)) {
      throw EngineError(ErrorKind::Timeout, "timed out after " + std::to_string(opt_.io_timeout_s) +
                                                " s with no read progress settling the IO queue");
    }
    if (interrupt) {
      lk.unlock();
      interrupt();
      lk.lock();
    }
  }
}

// ---- handshake ---------------------------------------------------------------------------

std::uint32_t ExpertStream::publish(std::uint32_t layer) {
  check_layer(layer);
  std::lock_guard<std::mutex> lk(mu_);
  require_open();
  return publish_locked(layer);
}

std::uint32_t ExpertStream::publish_locked(std::uint32_t layer) {
  if (!opt_.publish_prefetch) return 0;
  const PackLayout& L = layout();
  const std::uint32_t first = (layer + 1) * L.n_experts;
  // I10: the last two layers scan only what exists.
  const std::uint32_t last = std::min<std::uint32_t>((layer + 3) * L.n_experts, L.n_keys());
  std::uint32_t n = 0;
  for (std::uint32_t key = first; key < last; ++key) {  // I2: <= 2 * n_experts entries
    std::int32_t s = where_[key];
    if (s < 0) continue;
    Slot& sl = slots_[std::uint32_t(s)];
    if (sl.published || sl.load() != SlotState::Complete) continue;
    publish_slot(std::uint32_t(s));
    ++n;
  }
  stats_.published.fetch_add(n, std::memory_order_relaxed);
  return n;
}

void ExpertStream::enter_layer(ClientId who, std::uint32_t layer) {
  check_layer(layer);
  {
    std::lock_guard<std::mutex> lk(mu_);
    enter_layer_locked(client_locked(who), layer, true, nullptr, 0);
  }
  done_cv_.notify_all();  // the previous layer's protections may have made room
}

void ExpertStream::enter_layer(ClientId who, std::uint32_t layer, const std::int32_t* experts,
                               std::size_t n) {
  check_layer(layer);
  {
    std::lock_guard<std::mutex> lk(mu_);
    enter_layer_locked(client_locked(who), layer, false, experts, n);
  }
  done_cv_.notify_all();  // the previous layer's protections may have made room
}

void ExpertStream::enter_layer_locked(ProtectionSet& p, std::uint32_t layer, bool whole_layer,
                                      const std::int32_t* experts, std::size_t n) {
  const std::uint32_t E = layout().n_experts;
  STRATA_ASSERT(whole_layer || experts || n == 0, "an expert list of n > 0 needs its pointer");
  p.executing = layer;
  p.executing_keep.assign(E, whole_layer ? 1 : 0);
  for (std::size_t i = 0; !whole_layer && i < n; ++i)
    if (experts[i] >= 0 && std::uint32_t(experts[i]) < E)
      p.executing_keep[std::uint32_t(experts[i])] = 1;
  p.next = -1;
}

void ExpertStream::after_layer(ClientId who, std::uint32_t layer) {
  check_layer(layer);
  std::lock_guard<std::mutex> lk(mu_);
  after_layer_locked(client_locked(who), layer);
}

void ExpertStream::after_layer_locked(ProtectionSet& p, std::uint32_t layer) {
  if (p.executing != layer) p.executing_keep.assign(layout().n_experts, 1);
  p.executing = layer;
  // After the last layer the next router to run is the next token's layer 0.
  p.next = layer + 1 < layout().n_layers ? layer + 1 : 0;
}

void ExpertStream::end_turn(ClientId who) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    ProtectionSet& p = client_locked(who);
    p.executing = -1;
    p.next = -1;
  }
  done_cv_.notify_all();
}

void ExpertStream::plan(ClientId who, std::uint32_t layer, const std::int32_t* experts,
                        std::size_t n, std::uint8_t* resident) {
  check_experts(layer, experts, n);  // before any pin, so a bad id leaves no partial plan
  const std::uint32_t E = layout().n_experts;
  std::lock_guard<std::mutex> lk(mu_);
  require_open();
  ProtectionSet& p = client_locked(who);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t key = layer * E + std::uint32_t(experts[i]);
    std::uint32_t s = smap_load(smap_.get(), key);
    resident[i] = s != kAbsent;
    if (s != kAbsent) {
      ++slots_[s].pins;
      p.pinned.push_back(s);
    }
  }
}

void ExpertStream::release_plan(ClientId who) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    release_plan_locked(client_locked(who));
  }
  done_cv_.notify_all();
}

void ExpertStream::release_plan_locked(ProtectionSet& p) {
  for (std::uint32_t s : p.pinned) {
    STRATA_ASSERT(slots_[s].pins > 0, "pin count underflow");
    --slots_[s].pins;
  }
  p.pinned.clear();
}

// ---- lifecycle primitives ------------------------------------------------------------------

bool ExpertStream::cancel(std::uint32_t layer, std::uint32_t expert) {
  check_layer(layer);
  if (expert >= layout().n_experts) throw std::out_of_range("expert out of range");
  std::lock_guard<std::mutex> lk(mu_);
  require_open();
  std::int32_t s = where_[layer * layout().n_experts + expert];
  if (s < 0) return false;
  Slot& sl = slots_[std::uint32_t(s)];
  if (sl.load() != SlotState::Queued || sl.parts_started != 0) return false;  // I6
  recycle(std::uint32_t(s));
  stats_.cancelled.fetch_add(1, std::memory_order_relaxed);
  return true;
}

std::uint32_t ExpertStream::retire_unused_pre(std::uint32_t layer, const std::int32_t* chosen,
                                              std::size_t n) {
  check_layer(layer);
  std::lock_guard<std::mutex> lk(mu_);
  require_open();
  return retire_locked(layer, chosen, n);
}

std::uint32_t ExpertStream::retire_locked(std::uint32_t layer, const std::int32_t* chosen,
                                          std::size_t n) {
  const std::uint32_t E = layout().n_experts;
  std::vector<bool> keep(E, false);
  for (std::size_t i = 0; i < n; ++i)
    if (chosen[i] >= 0 && std::uint32_t(chosen[i]) < E) keep[std::uint32_t(chosen[i])] = true;
  std::uint32_t parked = 0;
  for (std::uint32_t e = 0; e < E; ++e) {
    if (keep[e]) continue;
    std::int32_t s = where_[layer * E + e];
    if (s < 0) continue;
    Slot& sl = slots_[std::uint32_t(s)];
    SlotState st = sl.load();
    if (sl.cls == ReadClass::Urgent || sl.used || sl.pins) continue;
    if (st != SlotState::Queued && st != SlotState::Reading && st != SlotState::Complete) continue;
    park(std::uint32_t(s));
    ++parked;
  }
  return parked;
}

std::uint32_t ExpertStream::release_limbo() {
  std::lock_guard<std::mutex> lk(mu_);
  return release_limbo_locked();
}

std::uint32_t ExpertStream::release_limbo_locked() {
  std::vector<std::uint32_t> done;
  for (std::uint32_t s : limbo_) {
    const Slot& sl = slots_[s];
    if (sl.limbo_releasable()) done.push_back(s);
  }
  for (std::uint32_t s : done) recycle(s);
  stats_.limbo_released.fetch_add(done.size(), std::memory_order_relaxed);
  return std::uint32_t(done.size());
}

std::int32_t ExpertStream::victim(bool speculative) const {
  std::lock_guard<std::mutex> lk(mu_);
  return pick_victim(speculative);
}

std::int32_t ExpertStream::evict_one() {
  std::lock_guard<std::mutex> lk(mu_);
  require_open();
  std::int32_t v = pick_victim(false);
  if (v >= 0) {
    recycle(std::uint32_t(v));
    stats_.evicted.fetch_add(1, std::memory_order_relaxed);
  }
  return v;
}

// ---- the two host points of a layer, each under one lock hold -------------------------------

AtLayerResult ExpertStream::at_layer(ClientId who, std::uint32_t layer,
                                     const std::int32_t* chosen, std::size_t n,
                                     const std::int32_t* predicted, std::size_t n_predicted,
                                     const InterruptCheck& interrupt,
                                     const std::int32_t* predicted2, std::size_t n_predicted2,
                                     std::uint32_t max_new2) {
  check_experts(layer, chosen, n);
  IoWaker waker{this};
  Lock lk(mu_);
  require_open();
  AtLayerResult r;
  enter_layer_locked(client_locked(who), layer, false, chosen, n);  // I4: what the device reads
  done_cv_.notify_all();  // the previous layer's protections may have made room for others
  r.urgent = request_locked(lk, who, layer, chosen, n, ReadClass::Urgent, interrupt);
  r.published = publish_locked(layer);  // I2: before the device is released
  if (n_predicted > 0 && layer + 1 < layout().n_layers)  // I10
    r.predicted =
        request_locked(lk, who, layer + 1, predicted, n_predicted, ReadClass::Pred1, interrupt);
  if (n_predicted2 > 0 && layer + 2 < layout().n_layers)  // I10
    r.predicted2 = request_locked(lk, who, layer + 2, predicted2, n_predicted2, ReadClass::Pred2,
                                  interrupt, max_new2);
  return r;
}

void ExpertStream::finish_layer(ClientId who, std::uint32_t layer, const std::int32_t* chosen,
                                std::size_t n) {
  check_layer(layer);
  std::lock_guard<std::mutex> lk(mu_);
  require_open();
  after_layer_locked(client_locked(who), layer);  // I4: layer+1's router may run now
  retire_locked(layer, chosen, n);  // I7
  release_limbo_locked();
}

// ---- IO ----------------------------------------------------------------------------------------

void ExpertStream::io_loop() {
  Lock lk(mu_);
  for (;;) {
    while (!closing_ && queue_.empty()) {
      ++io_sleeping_;
      io_cv_.wait(lk);
      --io_sleeping_;
    }
    if (closing_) return;
    IoJob job = queue_.pop();
    // Chain: more work and a sleeping thread, so wake one (after mu_ is released).
    execute_job(lk, job, !queue_.empty() && io_sleeping_ > 0);
  }
}

void ExpertStream::execute_job(Lock& lk, const IoJob& job, bool wake_another) {
  Slot& sl = slots_[job.slot];
  STRATA_ASSERT(sl.gen == job.gen, "queued jobs are dropped when their slot is recycled");
  SlotState st = sl.load();
  STRATA_ASSERT(st == SlotState::Queued || st == SlotState::Reading || st == SlotState::Limbo,
                "a job runs only for a loading slot");
  if (st == SlotState::Queued) sl.state.store(SlotState::Reading, std::memory_order_release);
  ++sl.parts_started;
  const bool speculative = job.cls != ReadClass::Urgent;  // as queued: promotion re-queues
  if (speculative) stats_.spec_parts_started.fetch_add(1, std::memory_order_relaxed);
  const std::uint32_t key = sl.key;
  const std::uint64_t rel = std::uint64_t(job.part) * opt_.part_bytes;
  const std::uint64_t len = std::min<std::uint64_t>(opt_.part_bytes, read_span_ - rel);
  const std::uint64_t offset = layout().record_offset(key) + rel;
  unsigned char* dst = arena_->slot(job.slot) + rel;
  lk.unlock();
  if (wake_another) io_cv_.notify_one();

  int err = 0;
  std::size_t got = 0;
  Fault fault;
  auto t0 = Clock::now();
  bool injected = faults_.take(key, job.part, &fault);
  if (injected && (fault.kind == FaultKind::Delay || fault.kind == FaultKind::Gate)) {
    if (fault.kind == FaultKind::Delay)
      std::this_thread::sleep_for(std::chrono::milliseconds(fault.delay_ms));
    else
      faults_.wait_gate(fault.delay_ms);
    injected = false;
  }
  if (injected)
    err = fault.kind == FaultKind::Errno ? fault.err : kShortRead;
  else if (opt_.simulate_io)
    got = std::size_t(len);
  else
    err = file_->read_fully(offset, dst, std::size_t(len), &got);
  std::uint64_t dt = ns_since(t0);

  lk.lock();
  if (speculative) stats_.spec_parts_done.fetch_add(1, std::memory_order_relaxed);
  stats_.read_ns.fetch_add(dt, std::memory_order_relaxed);
  stats_.bytes_read.fetch_add(got, std::memory_order_relaxed);
  if (err != 0 && !sl.failed_part) {
    sl.failed_part = true;
    sl.err = err;
    sl.err_offset = offset;
  }
  // The record's last part: check the CRC32C of the whole record before the part counts as done,
  // with mu_ released (milliseconds at the start, now ~0.2 ms for 2.6 MB, but never under the
  // lock every IO thread and the handshake need). Until ++parts_done the part is in flight, so
  // no recycle, eviction or limbo release touches the slot (I4, I7); park and revive may run.
  if (opt_.verify_reads && !opt_.simulate_io && !sl.failed_part &&
      sl.parts_done + 1 == sl.parts_total) {
    const unsigned char* record = arena_->slot(job.slot);
    lk.unlock();
    const bool bad = crc32c(record, std::size_t(layout().record_bytes)) != file_->checksums()[key];
    lk.lock();
    if (bad && !sl.failed_part) {
      sl.failed_part = true;
      sl.err = kChecksumMismatch;
      sl.err_offset = layout().record_offset(key);
    }
  }
  ++sl.parts_done;
  // Waiters (wait, settle, an urgent request short of slots) care about whole records and about
  // a parked slot's last read in flight, not about every part: waking them per part cost the
  // host a futex round trip, and the IO threads the lock it then held while rescanning.
  bool notify = false;
  if (sl.reads_finished()) {
    on_reads_finished(job.slot);
    notify = true;
  } else if (!sl.in_flight() && sl.load() == SlotState::Limbo) {
    notify = true;
  }
  if (notify) {
    lk.unlock();
    done_cv_.notify_all();
    lk.lock();
  }
}

void ExpertStream::on_reads_finished(std::uint32_t s) {
  Slot& sl = slots_[s];
  if (sl.load() == SlotState::Limbo) return;  // release_limbo recycles it
  STRATA_ASSERT(sl.load() == SlotState::Reading, "reads finish on a reading slot");
  if (sl.failed_part) {
    if (sl.cls == ReadClass::Urgent) {
      sl.state.store(SlotState::Failed, std::memory_order_release);  // wait() reports it
    } else {
      stats_.spec_failed.fetch_add(1, std::memory_order_relaxed);  // dropped, counted
      if (sl.pins == 0) recycle(s);
      else sl.state.store(SlotState::Failed, std::memory_order_release);
    }
    return;
  }
  // Release order: the bytes written by every part's pread happen-before this store.
  sl.state.store(SlotState::Complete, std::memory_order_release);
  stats_.reads_completed.fetch_add(1, std::memory_order_relaxed);
  // I2: only urgent completions publish from the IO side; speculation waits for publish(l).
  if (sl.cls == ReadClass::Urgent) publish_slot(s);
}

std::vector<JobInfo> ExpertStream::pending_jobs() const {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<JobInfo> out;
  for (const IoJob& j : queue_.snapshot())
    out.push_back(JobInfo{j.slot, slots_[j.slot].key, j.part, j.cls});
  return out;
}

bool ExpertStream::run_job(std::size_t index) {
  Lock lk(mu_);
  require_open();
  if (!threads_.empty())
    throw EngineError(ErrorKind::Config, "run_job is for manual IO (io_threads = 0)");
  if (index >= queue_.size()) return false;
  IoJob job = queue_.take(index);
  execute_job(lk, job);
  return true;
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

std::string ExpertStream::check_invariants() const {
  std::lock_guard<std::mutex> lk(mu_);
  const std::uint32_t K = layout().n_keys();
  std::ostringstream m;
  std::uint32_t limbo = 0;
  for (std::uint32_t key = 0; key < K; ++key) {
    std::uint32_t s = smap_load(smap_.get(), key);
    if (s == kAbsent) continue;
    if (s >= slots_.size()) return "I1: smap[" + std::to_string(key) + "] out of range";
    const Slot& sl = slots_[s];
    if (sl.load() != SlotState::Complete || sl.key != key || !sl.published)
      return "I1: smap[" + std::to_string(key) + "] = " + std::to_string(s) + " but that slot is " +
             to_string(sl.load()) + " holding key " + std::to_string(sl.key);
  }
  for (std::uint32_t s = 0; s < slots_.size(); ++s) {
    const Slot& sl = slots_[s];
    SlotState st = sl.load();
    if (st == SlotState::Limbo) ++limbo;
    if (st == SlotState::Free) {
      if (sl.key != kNoKey || sl.published) return "free slot " + std::to_string(s) + " holds a key";
      continue;
    }
    if (sl.key >= K || where_[sl.key] != std::int32_t(s))
      return "I5: slot " + std::to_string(s) + " and where_ disagree";
    if (sl.published != (smap_load(smap_.get(), sl.key) == s))
      return "I1: slot " + std::to_string(s) + " published flag disagrees with smap";
    if (st == SlotState::Limbo && sl.published) return "I7: limbo slot published";
  }
  for (std::uint32_t key = 0; key < K; ++key) {
    std::int32_t s = where_[key];
    if (s >= 0 && slots_[std::uint32_t(s)].key != key)
      return "where_[" + std::to_string(key) + "] points at a slot holding another key";
  }
  if (limbo != limbo_.size()) return "limbo list drifted";
  return "";
}

}  // namespace strata
