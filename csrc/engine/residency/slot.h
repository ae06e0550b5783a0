// One arena slot and its state machine.
//
//   Free --assign--> Queued --first part starts--> Reading --last part ok--> Complete
//                      |                              \--last part failed--> Failed
//                      +--cancel (no part begun)--> Free
//   Queued | Reading | Complete --park (unchosen speculative)--> Limbo --revive--> (by progress)
//   Complete | Failed | Limbo (no part in flight) --recycle--> Free
//
// Every field is owned by ExpertStream::mu_; `state` is additionally an atomic so that a reader
// outside the lock (the device thread's debug checks, stats) sees a completed slot's bytes: the
// last part's completion stores Complete with release order after all parts' preads.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "common/timing.h"

namespace strata {

constexpr std::uint32_t kAbsent = 0xFFFFFFFFu;  // smap value for "not published"
constexpr std::uint32_t kNoKey = 0xFFFFFFFFu;
// No cap on new reads (a request's max_new, a handshake's speculation budget).
constexpr std::uint32_t kUnlimitedReads = 0xFFFFFFFFu;

enum class SlotState : std::uint8_t { Free, Queued, Reading, Complete, Limbo, Failed };

// Why a read was issued; urgent work always runs first, then pred1, pred2, profile.
enum class ReadClass : std::uint8_t { Urgent = 0, Pred1 = 1, Pred2 = 2, Profile = 3 };
constexpr int kReadClasses = 4;

inline const char* to_string(SlotState s) {
  switch (s) {
    case SlotState::Free: return "free";
    case SlotState::Queued: return "queued";
    case SlotState::Reading: return "reading";
    case SlotState::Complete: return "complete";
    case SlotState::Limbo: return "limbo";
    case SlotState::Failed: return "failed";
  }
  return "?";
}

// The fields every host point reads (the handshake's lookups, victim choice, the limbo scan)
// come first and fit one cache line, which each slot starts on: between two host points the
// device and IO threads stream expert bytes through the caches, so each slot a host point
// touches is a miss, one line rather than two or three. The rest (a failure's details, a
// miss's timeline) is read only on those paths.
struct alignas(64) Slot {
  std::uint32_t key = kNoKey;  // layer * n_experts + expert, kNoKey when free
  std::atomic<SlotState> state{SlotState::Free};
  ReadClass cls = ReadClass::Urgent;
  std::uint16_t parts_total = 0;
  std::uint16_t parts_started = 0;
  std::uint16_t parts_done = 0;
  bool failed_part = false;     // some part failed; the slot ends Failed (or is dropped)
  bool published = false;       // mirrors smap[key] == this slot
  bool used = false;            // an urgent request touched it (for prediction accounting)
  std::uint32_t pins = 0;       // plan-resident pins (I8)
  std::uint32_t gen = 0;        // bumped by every recycle/cancel; IO jobs carry it
  std::uint64_t last_use = 0;   // LRU clock
  // Parts of a reading slot that park() took out of the IO queue before they began (nobody
  // chose the expert, so they are not read); revive() queues them again.
  std::vector<std::uint16_t> unread;
  // ---- the cold part ----
  // Why the first failed part failed: an errno (> 0), or kShortRead / kChecksumMismatch
  // (expert_stream.h); 0 while nothing failed.
  std::int32_t err = 0;
  std::uint64_t err_offset = 0; // file offset of the first failed part
  std::string cause;            // kObserverFailed: the observer's message
  // A miss's timeline, for a read urgent from its start (else `queued` stays unset): when assign
  // queued it, when its first part began, when the part that completed it ended its pread, when
  // its record observers returned. Its publication adds the spans to StreamStats' miss phases.
  struct MissTimes {
    Clock::time_point queued{}, first_part{}, last_pread{}, observed{};
  } miss;

  bool in_flight() const { return parts_started != parts_done; }
  bool reads_finished() const { return parts_done == parts_total; }
  // A limbo slot may be recycled once no read is in flight and none is still queued: park()
  // leaves none queued (a queued slot's parts are dropped, a reading slot's moved to `unread`).
  bool limbo_releasable() const {
    return !in_flight() && (reads_finished() || parts_started == 0 || !unread.empty());
  }
  SlotState load() const { return state.load(std::memory_order_acquire); }
};

}  // namespace strata
