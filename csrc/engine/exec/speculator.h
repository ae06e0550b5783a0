// Speculator: a Window's speculation policy (docs/architecture.md sections 2 and 6). At every
// host point it says what the handshake publishes and what it reads ahead: router l+1's and
// l+2's picks (lookahead), or with lookahead off layer l+1's profile favourites, within the one
// budget the prefetch governor allows; at a turn's start, the start layers' profile favourites.
// It feeds the governor one sample per handshake, and settles the IO before host points when
// moce routing must be deterministic.
//
// Threads. The Window's driving call (TurnGate's busy holder) calls everything but governor();
// mu_ guards the governor's writes and other threads' reads (the driving call reads it freely).
#pragma once

#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "exec/chunk_plan.h"
#include "exec/popularity.h"
#include "exec/recorder.h"
#include "policy/prefetch_governor.h"
#include "residency/expert_stream.h"

namespace strata {

struct SpeculatorOptions {
  bool lookahead = true;  // router l+1 on layer l's input
  // Router l+2 too (decode-sized chunks / larger ones), and the cap on its new reads per
  // handshake.
  bool two_layer_decode = false;
  bool two_layer_prompt = false;
  std::uint32_t two_layer_max = 64;
  // At turn start, profile-ranked experts of layers 0..n-1 (layer 0 up to top_k of them, later
  // layers up to 32 new reads each).
  std::uint32_t start_layers = 1;
  // Lookahead off: layer l+1's profile favourites as Profile reads.
  bool profile_prefetch = true;
  // A PrefetchGovernor caps the speculative reads each handshake starts; off, unlimited.
  bool prefetch_backoff = true;
  GovernorOptions governor;
  // Together with the stream's publish_prefetch, whether IO settles before host points (moce
  // routing that is a function of the inputs: settle()).
  MoceMode moce = MoceMode::Off;
  bool split_turn = false;
};

class Speculator {
 public:
  // The profile fallback queues top_k experts per row of at most this many rows: one decode
  // token needs top_k experts of l+1, and for a prompt chunk the next layer's own urgent waves
  // read the rest anyway, so more would only sit in the IO queue in front of them.
  static constexpr std::uint32_t kProfileRowsMax = 2;

  Speculator(ExpertStream& stream, Recorder& recorder, const SpeculatorOptions& options);

  // Whether IO settles before host points (see settle() in speculator.cpp).
  bool settles() const { return settles_; }
  // New speculative reads the handshake of `layer` may start: the governor's cap there (which
  // also gates layer + 1's speculation by its measured precision), or unlimited.
  std::uint32_t cap(std::uint32_t layer) const;
  PrefetchGovernor governor() const;  // a snapshot, from any thread

  // A turn opens: the start layers' favourites are queued as Profile reads, each layer's
  // within its per-layer cap, and counted as that layer's evidence.
  void start_turn(ClientId client);
  // Waits for every queued and in-flight read before a host point that changes the slot table,
  // when the Window settles (timed into the layer's settle_ns).
  void settle(std::uint32_t layer, const InterruptCheck& interrupt);
  // The speculation of a host point into `q`: publish at the chunk's first, and behind its last
  // the plan's predictions (from the scratch's pred ids `pred1`, `pred2`) or the profile's
  // favourites. Router l+1's picks are noted for precision when `chunk` reaches layer l+1.
  void fill(const ChunkPlan& p, std::uint32_t chunk, const std::int32_t* pred1,
            const std::int32_t* pred2, bool first, bool last, HandshakeRequest& q);
  // Less the predictions of a layer that can do nothing (Window::wants_predictions).
  Lookahead useful(std::uint32_t layer, Lookahead l) const;

  // Was speculation reading while the host waited for urgent reads? Brackets the wait.
  struct Watch {
    std::uint64_t in_flight_before = 0, started_before = 0;
  };
  Watch watch() const;
  bool overlapped(const Watch& w) const;
  // One handshake's evidence for the governor: a decode or a prompt one, whether its urgent
  // reads missed, and whether speculation read meanwhile, its layer call's wall time, and its
  // layer (what it started is layer + 1's evidence, what it used its own).
  void observe(bool decode, bool missed, bool contended, std::uint64_t wall_ns,
               std::uint32_t layer);

 private:
  // Layer `layer`'s experts the profile has seen, most popular first (ties to the lower id),
  // at most n of them, into `out`.
  void profile_ranked(std::uint32_t layer, std::size_t n, std::vector<std::int32_t>& out) const;
  // Lookahead off: layer+1's profile favourites that a chunk of `rows` rows more likely than not
  // uses, into `out` (empty when the fallback is off or beyond the last layer: I10).
  void profile_candidates(std::uint32_t layer, std::uint32_t rows,
                          std::vector<std::int32_t>& out) const;
  // Every expert of `layer` published, in an arena that holds every expert of the pack (so it
  // stays so): a prediction of that layer would request and protect nothing.
  bool all_resident_for_good(std::uint32_t layer) const;
  // The per-layer cap on the reads queued for `layer` at a turn's start, and their evidence.
  std::uint32_t start_cap(std::uint32_t layer) const;
  void observe_start(std::uint32_t layer, std::uint64_t issued);
  // The per-rank gate (prefetch_governor.h, 4.). hold_back_ranks: drops from `ranked` (layer
  // `layer`'s predictions, best first) the absent ones whose rank is gated, and keeps every
  // absent one as evidence for `layer`'s next handshake, when `scored` (one row, its whole
  // urgent request in one handshake); score_ranks, at that handshake, tells the governor which
  // of them its urgent request chose.
  bool rank_gate() const;
  void hold_back_ranks(std::uint32_t layer, bool scored, std::vector<std::int32_t>& ranked);
  void score_ranks(std::uint32_t layer, bool whole, const std::int32_t* urgent, std::size_t n);

  ExpertStream& stream_;
  Recorder& recorder_;
  const PackLayout& L_;
  const SpeculatorOptions opt_;
  const bool settles_;
  Popularity popularity_;
  std::vector<std::int32_t> pred1_, pred2_, profile_;  // the host point's lists (q points here)

  mutable std::mutex mu_;
  PrefetchGovernor governor_;  // mu_ for writes and other threads' reads
  // The stream's spec_requests / spec_hits at the last governor sample (deltas feed it).
  std::uint64_t gov_issued_ = 0, gov_used_ = 0;
  // The rank gate's evidence awaiting layer pending_layer_'s handshake: (rank, expert) of each
  // prediction that was absent when made.
  static constexpr std::uint32_t kNoPending = 0xFFFFFFFFu;
  std::uint32_t pending_layer_ = kNoPending;
  std::vector<std::pair<std::uint32_t, std::int32_t>> pending_;
};

}  // namespace strata
