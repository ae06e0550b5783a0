// ExpertStream: owns expert lifetime, pending IO and slot residency (docs/architecture.md section 4).
//
// Concurrency. One mutex, mu_, guards every slot field, where_, the free list, the IO queue and
// the protection sets (one per client: see protection_set.h). clients_mu_ guards the client
// registry's close hooks and is always taken before mu_, never while holding it. Every public
// method may be called from any thread. IO threads take mu_ once per part, to record a
// completion and pop the next job; the pread runs unlocked straight into the slot's bytes, and
// so does the CRC32C of each part (verify_reads), by the thread that read it; the thread that
// finishes a record's last part combines the parts' CRCs while that part still counts as in
// flight, so nothing can recycle the slot under it.
// smap is a plain uint32 array so
// a device can map it; the host writes it only under mu_ and every access goes through
// std::atomic_ref (release on store, acquire on load), so a device thread reading it
// concurrently is race-free.
//
// Invariants I1-I10 of docs/architecture.md: each slot transition asserts the ones it relies on
// (STRATA_ASSERT, on in debug and sanitizer builds); the invariant checker scans the whole table
// for I1 and I3-I7 on demand, and tests/test_stream_state_machine.py calls it after every step.
//
// IO completion observers (residency/record_observer.h): observers_mu_ guards the list and each
// entry's count of calls in progress; IO threads call observers holding neither lock, and
// remove_observer waits on observers_cv_ until no call into the removed observer is in progress.
// observers_mu_ and mu_ are never held together.
//
// Tests reach the hooks that are no part of the product (manual IO, fault injection, the
// invariant checker, forced eviction) through StreamTesting (residency/stream_testing.h) only.
//
// The implementation is one file per concept: expert_stream.cpp (construction, close, views),
// stream_clients.cpp, slot_transitions.cpp, stream_eviction.cpp, stream_requests.cpp (with the
// one bounded wait), stream_handshake.cpp, stream_io.cpp, stream_disposal.cpp and
// stream_invariants.cpp.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/errors.h"
#include "residency/arena.h"
#include "residency/eviction_policy.h"
#include "residency/io_queue.h"
#include "residency/lru_list.h"
#include "residency/protection_set.h"
#include "pack/pack_file.h"
#include "residency/record_observer.h"
#include "residency/slot.h"
#include "residency/stats.h"
#include "common/timing.h"

namespace strata {

struct StreamOptions {
  std::uint64_t arena_bytes = 1ull << 30;
  // StreamConfig (strata_stream/config.py) says why these; it takes 4 to 8 IO threads by the
  // core count.
  std::uint32_t io_threads = 8;  // 0 = manual IO: tests run each part read (StreamTesting)
  std::uint64_t part_bytes = 256ull << 10;  // the largest part (balanced_part_bytes)
  bool direct_io = true;
  bool verify_reads = true;  // CRC32C of every record read (skipped with simulate_io)
  double io_timeout_s = 60.0;
  // How long an IO thread that ran out of jobs, and an urgent wait() whose reads are in flight,
  // spin before they sleep (0: never). A spin pays when the next request (or the record's last
  // part) comes within it: the miss skips a futex wake, tens of microseconds on a VM; it holds
  // a core meanwhile, so it is opt-in (benchmarks/miss_latency.py --io-spin-us measures it).
  std::uint32_t io_spin_us = 0;
  bool publish_prefetch = true;  // STRATA_METAL_PUBLISH_PREFETCH
  EvictionPolicy eviction = EvictionPolicy::DecayedLfu;  // STRATA_EVICTION
  // Replay only: part reads complete without touching the file, so routing traces replay
  // through the real residency code at memory speed. Expert bytes are then undefined.
  bool simulate_io = false;
};

struct RequestResult {
  std::uint32_t hits = 0;
  std::uint32_t misses = 0;
  std::uint32_t spec_started = 0;  // speculative reads started
  std::uint32_t dropped = 0;  // speculative requests that found no space
};

// One host point of the handshake (docs/architecture.md section 2): a decode chunk's at_layer,
// or one wave of a prompt chunk. The lists are expert ids; each speculative list is ordered
// most wanted first and queued behind everything before it.
struct HandshakeRequest {
  std::uint32_t layer = 0;
  // The routed experts the device reads next: protected (I4) and requested urgently.
  const std::int32_t* urgent = nullptr;
  std::size_t n_urgent = 0;
  bool publish = true;  // publish completed prefetches of l+1..l+2 (I2): a chunk's first point
  // An earlier chunk of this client's call at the same layer returned with its kernels queued:
  // its experts stay protected and these are added to them (I4), instead of replacing them.
  // Only for the layer the client is executing (a different layer is a new call: nothing of
  // the last one may still be queued then).
  bool keep_executing = false;
  // Router l+1's picks (lookahead), router l+2's (two-layer lookahead), and (lookahead off)
  // layer l+1's profile favourites.
  const std::int32_t* next_layer = nullptr;
  std::size_t n_next_layer = 0;
  const std::int32_t* two_layer = nullptr;
  std::size_t n_two_layer = 0;
  const std::int32_t* profile = nullptr;
  std::size_t n_profile = 0;
  // The one speculation budget: new reads Pred1, then Pred2, then Profile may start together
  // (0: none of them is requested); Pred2's share is further capped by two_layer_max. I9 holds
  // regardless: speculation never waits for space.
  std::uint32_t spec_budget = kUnlimitedReads;
  std::uint32_t two_layer_max = kUnlimitedReads;
};

struct AtLayerResult {
  RequestResult urgent;     // the routed experts
  RequestResult predicted;  // router l+1's picks, queued behind them
  RequestResult predicted2; // router l+2's picks, behind those
  RequestResult profile;    // the profile fallback, last
  std::uint32_t published = 0;
};

struct SlotInfo {
  std::uint32_t slot, key;
  SlotState state;
  ReadClass cls;
  std::uint16_t parts_total, parts_started, parts_done;
  bool published, failed;
  std::uint32_t pins;
  std::uint64_t last_use;
};

// Called (without mu_) while a wait blocks; returns normally or throws to abort the wait.
using InterruptCheck = std::function<void()>;

// Why a failed slot failed (Slot::err), where it is not an errno (> 0): a read that came back
// short (kShortRead), a record that failed its CRC32C (kChecksumMismatch), or one a record
// observer refused (kObserverFailed).
constexpr int kShortRead = -1;
constexpr int kChecksumMismatch = -2;
// A record observer (record_observer.h) threw at IO completion; Slot::cause says why.
constexpr int kObserverFailed = -3;

class FaultInjector;        // residency/fault_injection.h: tests' failing reads
struct StreamTesting;       // residency/stream_testing.h: the testing seam
struct JobInfo;

class ExpertStream {
 public:
  ExpertStream(const std::string& pack_path, const StreamOptions& options);
  ~ExpertStream();
  ExpertStream(const ExpertStream&) = delete;
  ExpertStream& operator=(const ExpertStream&) = delete;

  // ---- lifecycle ----------------------------------------------------------------------------
  static constexpr double kForever = std::numeric_limits<double>::infinity();
  // Closes every registered client first (a Window waits for its layer in flight, then fails its
  // turn with Closed and frees its device and scratch), then stops the IO threads after their
  // current part; queued reads are dropped. Returns false when an IO thread did not exit within
  // bound_s (a read stuck in the kernel): the stream is closed all the same, and that thread still
  // writes into the arena, so the memory stays valid until it exits (the destructor waits for it;
  // dispose() waits on a background thread instead). Idempotent; safe from several threads at once.
  bool close(double bound_s = kForever);
  bool closed() const;
  // Destroys `stream` now when its IO threads exit within bound_s, else hands it to a background
  // thread that destroys it once they do, so a stuck read blocks no caller and frees nothing in use.
  static void dispose(std::unique_ptr<ExpertStream> stream, double bound_s);
  static std::size_t disposing();  // streams a background thread is still waiting to destroy
  // The reads still in flight, named by layer, expert and part ("" when none).
  std::string describe_in_flight() const;

  // ---- clients: each Window registers one and owns its protections ------------------------
  // `on_close` is called (without mu_) by close() to close the client first; it must be
  // idempotent and must not call open_client/close_client. Throws Closed on a closed stream.
  ClientId open_client(std::function<void()> on_close);
  // Drops the client's protections and pins (its turn is over, no device work of it in flight).
  void release_client(ClientId who);
  // Unregisters the client (released first). Waits while close() is calling its hook.
  void close_client(ClientId who);
  std::size_t n_clients() const;  // registered clients, the stream's own excluded
  // Clients whose urgent request is blocked waiting for another client to release a slot.
  std::size_t clients_waiting_for_space() const;

  const PackLayout& layout() const { return file_->layout(); }
  const PackFile& file() const { return *file_; }
  std::uint32_t n_slots() const { return arena_->n_slots(); }
  std::uint32_t n_parts() const { return n_parts_; }  // part reads per expert record
  std::uint64_t part_bytes() const { return part_bytes_; }  // each but the last part's length
  const Arena& arena() const { return *arena_; }
  const StreamOptions& options() const { return opt_; }
  // One layer's top-k being executed plus the next layer's, whose router may be running.
  static std::uint32_t min_slots(const PackLayout& L) { return 2 * L.top_k; }

  // ---- IO completion observers (residency/record_observer.h) -------------------------------
  // Registers `observer`: it sees every record whose reads complete after this returns (a
  // record completing meanwhile may or may not be seen), before the record can be published.
  // The caller keeps it alive until remove_observer returned.
  ObserverId add_observer(RecordObserver* observer);
  // Unregisters it and returns once no thread is inside it (a call in progress finishes first;
  // none starts after), so the observer may then be destroyed. Unknown ids are ignored. Never
  // from inside an observer (it would wait for itself).
  void remove_observer(ObserverId id);
  std::size_t n_observers() const;

  // ---- requests -------------------------------------------------------------------------
  // Urgent: every expert becomes resident or loading, evicting if needed (waits for an in-flight
  // read when every slot is busy: EngineError(Timeout) after io_timeout_s with no read
  // progress, the rule of wait() and settle()). Speculative: takes only free or evictable slots,
  // never of the executing or next layer; stops at the first that finds none (I9).
  // max_new caps how many experts not already present it starts reading (speculative caps).
  RequestResult request(std::uint32_t layer, const std::int32_t* experts, std::size_t n,
                        ReadClass cls, const InterruptCheck& interrupt = {},
                        std::uint32_t max_new = kUnlimitedReads) {
    return request(kStreamClient, layer, experts, n, cls, interrupt, max_new);
  }
  // As the client `who`: an urgent request that finds every slot protected waits (bounded by
  // io_timeout_s) while another client that could release one holds protections, and fails
  // with ArenaFull when none can (every other holder is itself waiting, or the time is up).
  RequestResult request(ClientId who, std::uint32_t layer, const std::int32_t* experts,
                        std::size_t n, ReadClass cls, const InterruptCheck& interrupt = {},
                        std::uint32_t max_new = kUnlimitedReads);
  // Blocks until every listed expert is complete and published. Throws ExpertReadError for a
  // failed read (and recycles that slot), EngineError(Timeout) after io_timeout_s with no
  // progress. Experts not yet requested are requested urgently first.
  void wait(std::uint32_t layer, const std::int32_t* experts, std::size_t n,
            const InterruptCheck& interrupt = {}) {
    wait(kStreamClient, layer, experts, n, interrupt);
  }
  void wait(ClientId who, std::uint32_t layer, const std::int32_t* experts, std::size_t n,
            const InterruptCheck& interrupt = {});

  // ---- the handshake's host points, each one lock hold (the Window's hot path) --------------
  // at_layer: the one call of a host point, for decode and for every prompt wave alike.
  // Protects exactly the urgent experts as the executing layer's (I4), requests them urgently,
  // publishes completed prefetches of l+1..l+2 (I2, when asked), then queues the speculative
  // lists within the budget (I9, I10: nothing for a layer >= L).
  AtLayerResult at_layer(ClientId who, const HandshakeRequest& request,
                         const InterruptCheck& interrupt = {});
  AtLayerResult at_layer(const HandshakeRequest& request, const InterruptCheck& interrupt = {}) {
    return at_layer(kStreamClient, request, interrupt);
  }
  // after_layer(l) + retire_unused_pre(l, chosen) + release_limbo().
  void finish_layer(std::uint32_t layer, const std::int32_t* chosen, std::size_t n) {
    finish_layer(kStreamClient, layer, chosen, n);
  }
  void finish_layer(ClientId who, std::uint32_t layer, const std::int32_t* chosen, std::size_t n);

  // Blocks until no read is queued or in flight, so that the slot table stops depending on
  // when IO happens to finish (the deterministic moce path, see Window). Bounded like wait():
  // io_timeout_s without progress is a Timeout; `interrupt` is polled.
  void settle(const InterruptCheck& interrupt = {});

  // ---- handshake pieces -----------------------------------------------------------------
  // Publishes completed, non-limbo slots of layers l+1..l+2 (I2); scans <= 2 * n_experts keys.
  std::uint32_t publish(std::uint32_t layer);
  // Marks `layer` as executing (I4). Without an expert list its every slot is protected until
  // the next enter/end; with one, only the listed experts are (none for an empty list): the
  // ones the device reads in this call (a prompt chunk may route to more experts of a layer
  // than the arena holds, and runs them in waves, each entering with its own experts).
  // Each takes the client whose protections it changes; without one, the stream's own set.
  void enter_layer(std::uint32_t layer) { enter_layer(kStreamClient, layer); }
  void enter_layer(std::uint32_t layer, const std::int32_t* experts, std::size_t n) {
    enter_layer(kStreamClient, layer, experts, n);
  }
  void enter_layer(ClientId who, std::uint32_t layer);
  void enter_layer(ClientId who, std::uint32_t layer, const std::int32_t* experts, std::size_t n);
  void after_layer(std::uint32_t layer) { after_layer(kStreamClient, layer); }
  void after_layer(ClientId who, std::uint32_t layer);  // also protect layer+1 (its router may run)
  void end_turn() { end_turn(kStreamClient); }
  void end_turn(ClientId who);  // no device work of `who` in flight: drop its layer protections
  // Snapshots which experts are resident (published) and pins their slots until release_plan (I8).
  void plan(std::uint32_t layer, const std::int32_t* experts, std::size_t n, std::uint8_t* resident) {
    plan(kStreamClient, layer, experts, n, resident);
  }
  void plan(ClientId who, std::uint32_t layer, const std::int32_t* experts, std::size_t n,
            std::uint8_t* resident);
  // The same snapshot as slot numbers, taken under mu_: slots[i] is the published slot of
  // experts[i], kAbsent when it has none; with `pin` those slots are pinned until release_plan.
  void plan_slots(ClientId who, std::uint32_t layer, const std::int32_t* experts, std::size_t n,
                  std::uint32_t* slots, bool pin);
  void release_plan() { release_plan(kStreamClient); }
  void release_plan(ClientId who);

  // ---- lifecycle primitives -------------------------------------------------------------
  bool cancel(std::uint32_t layer, std::uint32_t expert);  // queued only (I6)
  // Parks this layer's speculative slots whose expert is not in `chosen` in limbo (I7).
  std::uint32_t retire_unused_pre(std::uint32_t layer, const std::int32_t* chosen, std::size_t n);
  std::uint32_t release_limbo();  // recycles limbo slots whose reads finished

  // ---- views ----------------------------------------------------------------------------
  const std::uint32_t* smap() const { return smap_.get(); }
  std::uint32_t smap_at(std::uint32_t key) const;
  // The smap index of (layer, expert). Throws EngineError(Config) naming the layer or expert
  // out of range: an unchecked expert would alias another layer's key.
  std::uint32_t key(std::int64_t layer, std::int64_t expert) const;
  // The slot holding (layer, expert) in any state, or -1; range-checked as key().
  std::int32_t where(std::int64_t layer, std::int64_t expert) const;
  std::vector<SlotInfo> slots() const;
  const StreamStats& stats() const { return stats_; }

 private:
  friend struct StreamTesting;
  // ---- testing hooks, reached through StreamTesting only ------------------------------------
  std::int32_t victim(bool speculative = false) const;  // the slot eviction would pick, or -1
  std::int32_t evict_one();                              // evicts victim(), returns it or -1
  std::vector<JobInfo> pending_jobs() const;             // manual IO: the queue, in order
  bool run_job(std::size_t index);  // runs the index-th pending part read, in priority order
  // Verifies I1, I3-I7 over the whole table; returns "" or the first violation.
  std::string check_invariants() const;

  using Lock = std::unique_lock<std::mutex>;

  struct IoWaker {  // wakes the IO threads once mu_ is released, on every exit path
    ExpertStream* self;
    ~IoWaker() { self->wake_io(); }
  };
  RequestResult request_locked(Lock& lk, ClientId who, std::uint32_t layer,
                               const std::int32_t* experts, std::size_t n, ReadClass cls,
                               const InterruptCheck& interrupt,
                               std::uint32_t max_new = kUnlimitedReads);
  // request_locked's steps, in the order it takes them for each expert (stream_requests.cpp).
  struct RequestGuards;
  bool hold_resident(std::uint32_t key, ReadClass cls, RequestResult& r, RequestGuards& guards);
  bool start_read(std::uint32_t key, ReadClass cls, RequestResult& r, RequestGuards& guards);
  RequestResult finish_request(ReadClass cls, const RequestResult& r);
  std::uint32_t publish_locked(std::uint32_t layer);
  // The client's protection set; throws Closed when it is not registered (closed under a call).
  ProtectionSet& client_locked(ClientId who);
  // whole_layer: protect every slot of `layer`; else exactly experts[0, n) (n may be 0: the
  // pointer is not the signal, since an empty vector's data() may be null), or with keep (the
  // layer already executing) experts[0, n) as well as those it protects.
  void enter_layer_locked(ProtectionSet& p, std::uint32_t layer, bool whole_layer,
                          const std::int32_t* experts, std::size_t n, bool keep = false);
  void after_layer_locked(ProtectionSet& p, std::uint32_t layer);
  void release_plan_locked(ProtectionSet& p);
  // Whether some client other than `who` holds protections and is not itself waiting for space:
  // then waiting for it to move on can free a slot.
  bool another_client_may_release(ClientId who) const;
  void io_exited();  // the last thing an IO thread does
  std::uint32_t retire_locked(std::uint32_t layer, const std::int32_t* chosen, std::size_t n);
  std::uint32_t release_limbo_locked();
  void check_experts(std::uint32_t layer, const std::int32_t* experts, std::size_t n) const;
  // Bounded waits, one rule for all three (wait(), settle() and an urgent request waiting for a
  // free slot): io_timeout_s without any read progress (stats_.bytes_read unchanged) is a
  // Timeout, however long the wait as a whole; a slow but moving SSD never times out, a stuck
  // one always does.
  struct ReadProgress {
    Clock::time_point at;      // when bytes_read last moved
    std::uint64_t bytes_read;  // stats_.bytes_read then
  };
  ReadProgress read_progress() const;
  // wait()'s steps (stream_requests.cpp).
  struct WaitScan {
    bool all = true;             // every waited-for slot complete
    std::uint32_t pending = 0;   // else the first slot not yet complete
    bool pending_reads = false;  // and its reads still to finish (Queued or Reading)
  };
  void request_unrequested(ClientId who, std::uint32_t layer, const std::int32_t* experts,
                           std::size_t n, const InterruptCheck& interrupt);
  WaitScan scan_waited(Lock& lk, ClientId who, std::uint32_t layer, const std::int32_t* experts,
                       std::size_t n, const InterruptCheck& interrupt);
  void run_next_part_inline(Lock& lk, std::uint32_t s);
  void wait_for_space(Lock& lk, RequestGuards& guards, std::uint32_t layer, std::int32_t expert,
                      std::optional<ReadProgress>& progress, const InterruptCheck& interrupt);
  // One step of that wait, the only one: blocks (mu_ released) up to 50 ms for a part to
  // finish; throws timed_out() once io_timeout_s has passed with no read progress; polls
  // `interrupt` with mu_ released (it may throw); throws Closed when the stream closed meanwhile.
  void bounded_wait_step(Lock& lk, ReadProgress& p, const InterruptCheck& interrupt,
                         const std::function<EngineError()>& timed_out);
  void io_loop();
  // io_spin_us: polls the queue's hint with mu_ released until a job may be queued or the spin
  // is over; the caller re-checks under mu_ (closing_ included: the spin is bounded).
  void spin_for_jobs() const;
  // io_spin_us: polls slot s's state with mu_ released until its reads are over (Complete or
  // Failed) or `budget` has passed; returns the time spun. A hint: the caller re-checks under
  // mu_, whatever became of the slot meanwhile.
  std::chrono::nanoseconds spin_for_slot(std::uint32_t s, std::chrono::nanoseconds budget) const;
  // Runs one part read: bookkeeping under mu_, the pread (and, for a record's last part, the
  // checksum) with mu_ released. Entered and left with `lk` held. `wake`: sleeping IO threads to
  // wake once mu_ is released (work remains queued for them). `done_owed` (the IO threads'
  // loop): when true on entry, done_cv_ is notified once mu_ is released; set on exit when the
  // job finished what a waiter waits for, instead of notifying then (without it, notified now).
  void execute_job(Lock& lk, const IoJob& job, std::uint32_t wake = 0,
                   bool* done_owed = nullptr);
  // execute_job's steps, in order (stream_io.cpp): under mu_, without it, without it, under
  // it, then for a record's last part (mu_ released inside), then the waiters.
  struct PartRead;
  PartRead begin_part(const IoJob& job, Clock::time_point job_start);
  void read_part(const IoJob& job, PartRead& part);
  void check_part(const IoJob& job, PartRead& part);
  void count_part(const IoJob& job, PartRead& part);
  void finish_record(Lock& lk, const IoJob& job, const PartRead& part);
  void wake_part_waiters(Lock& lk, std::uint32_t s, bool* done_owed);
  void on_reads_finished(std::uint32_t s);
  // Adds a published urgent read's timeline to the miss phases (stats.h).
  void count_miss_times(const Slot::MissTimes& t);
  // Calls every registered observer (without mu_) on a record whose bytes are complete, or
  // (record null) on one part just read; false, with the first failure's message in `cause`,
  // when one threw (the rest are not called).
  bool notify_observers(const CompletedRecord* record, const ReadPart& part, std::string* cause);
  std::int32_t take_slot(bool speculative);
  std::int32_t pick_victim(bool speculative) const;
  bool evictable(std::uint32_t s, bool speculative) const;  // no rule protects slot s
  std::int32_t pick_coldest_heat(bool speculative) const;   // EvictionPolicy::DecayedLfu
  std::int32_t pick_queued_speculative() const;
  bool is_protected(std::uint32_t key, bool speculative) const;
  void assign(std::uint32_t s, std::uint32_t key, ReadClass cls);
  void enqueue_parts(std::uint32_t s);
  // Notifies the IO threads of queued work outside mu_, so they do not wake only to block on it.
  void wake_io();
  void touch(std::uint32_t s);
  void recycle(std::uint32_t s);
  void park(std::uint32_t s);
  void revive(std::uint32_t s, ReadClass cls);
  void publish_slot(std::uint32_t s);
  void unpublish(std::uint32_t s);
  void make_urgent(std::uint32_t s);
  void require_open() const;
  void check_layer(std::uint32_t layer) const;
  [[noreturn]] void throw_read_error(std::uint32_t s);
  std::uint32_t record_crc(std::uint32_t s) const;  // the parts' CRCs combined (part_crc_)
  std::string describe_full(ClientId who) const;

  StreamOptions opt_;
  std::unique_ptr<PackFile> file_;
  std::unique_ptr<Arena> arena_;
  std::uint32_t n_parts_ = 0;   // immutable after construction
  std::uint64_t part_bytes_ = 0;  // balanced_part_bytes of opt_.part_bytes; immutable
  std::uint64_t read_span_ = 0;  // record_bytes rounded up to the O_DIRECT granularity
  // [slot][part]: the CRC32C of the record's bytes in that part (verify_reads). Written by the
  // IO thread that read the part, without mu_, before it takes mu_ to count the part done; read
  // by the thread that counts the record's last part, after that count (mu_ orders them). A
  // slot's entries are rewritten only by its next generation's reads.
  std::vector<std::uint32_t> part_crc_;

  struct SmapFree { void operator()(std::uint32_t* p) const; };
  std::unique_ptr<std::uint32_t[], SmapFree> smap_;  // writes under mu_, atomic_ref access

  mutable std::mutex mu_;
  std::condition_variable io_cv_;    // jobs queued or closing
  std::condition_variable done_cv_;  // a part finished
  std::vector<Slot> slots_;          // mu_
  std::vector<std::int32_t> where_;  // mu_: key -> slot in any state, -1 absent
  std::vector<std::uint32_t> free_;  // mu_: free slots (stack)
  IoQueue queue_;                    // mu_
  std::uint64_t clock_ = 0;          // mu_: LRU clock (last_use stamps, for reporting)
  LruList lru_;                      // mu_: every non-free slot, coldest first
  KeyHeat heat_;                     // mu_: per-key use heat for EvictionPolicy::DecayedLfu
  // mu_: DecayedLfu's victim order over the non-free slots. mutable: pick_victim settles it
  // lazily, an index update that changes no slot's state.
  mutable HeatOrder heat_order_;
  std::vector<std::uint32_t> limbo_;  // mu_: slots in limbo
  std::vector<char> retire_keep_;     // mu_: retire_locked's marks, all zero between calls
  // mu_: every client's protections (I4, I8), kStreamClient's always present. A std::map so
  // that a reference to one client's set survives other clients registering or leaving.
  std::map<ClientId, ProtectionSet> clients_;
  std::uint32_t next_client_ = 1;  // mu_: the next ClientId handed out
  bool closing_ = false;             // mu_: set once by close(); no request or client after it
  // mu_: close() is closing the clients: a request waiting for another client to release a slot
  // gives up (Closed) instead of waiting out io_timeout_s for a Window that is being closed.
  bool closing_clients_ = false;
  std::uint32_t live_io_ = 0;        // mu_: IO threads that have not returned yet
  std::condition_variable exit_cv_;  // an IO thread returned
  // clients_mu_: close hooks of the registered clients. close() calls them holding clients_mu_
  // (so close_client waits for a hook in progress); they never take clients_mu_ themselves.
  std::mutex clients_mu_;
  std::map<ClientId, std::function<void()>> closers_;
  // mu_: IO threads blocked on io_cv_; a thread that pops a job and leaves more queued wakes
  // as many of them as there are jobs left (only then: a notify with nobody asleep is wasted
  // work on the IO path). io_signalled_: those woken by IO threads and not yet running, so
  // two threads do not wake one sleeper twice for two jobs (a hint: the host's own wake-up
  // and spurious wake-ups are not counted; a miscount only wakes a thread early or late).
  std::uint32_t io_sleeping_ = 0;
  std::uint32_t io_signalled_ = 0;
  // Jobs were queued since the IO threads were last woken: set under mu_, consumed by the
  // IoWaker that ends request() after mu_ is released.
  std::atomic<bool> wake_io_{false};
  // mu_: the IO threads; close() moves them out under mu_ and joins them once they returned, so
  // two closers never join one thread twice. Empty for manual IO (while open).
  std::vector<std::thread> threads_;
  // Consulted by every part read (one relaxed load while no fault was ever added); its own lock.
  std::unique_ptr<FaultInjector> faults_;
  // observers_mu_: the registered record observers, in registration order. A std::list so an
  // entry an IO thread is calling stays put while others are added or removed; `calls` counts
  // the calls in progress (remove_observer waits on observers_cv_ for 0), `removed` stops new
  // ones. Lock order: observers_mu_ is never taken with mu_ held, nor mu_ with it held.
  struct ObserverEntry {
    ObserverId id;
    RecordObserver* observer;
    std::uint32_t calls = 0;
    bool removed = false;
  };
  mutable std::mutex observers_mu_;
  std::condition_variable observers_cv_;  // a call into a removed observer returned
  std::list<ObserverEntry> observers_;    // observers_mu_
  std::uint32_t next_observer_ = 1;       // observers_mu_
  StreamStats stats_;
};

const char* to_string(ReadClass c);

// The length of a record's parts (each but the last): equal parts of whole kPages, at most
// `cap`, their count a multiple of `threads` where that keeps them at least 64 KiB.
std::uint64_t balanced_part_bytes(std::uint64_t span, std::uint64_t cap, std::uint32_t threads);

}  // namespace strata
