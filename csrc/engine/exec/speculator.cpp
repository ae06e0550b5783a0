#include "exec/speculator.h"

#include <algorithm>
#include <cmath>

#include "residency/smap.h"

namespace strata {

namespace {

// With moce on, routing reads residency, and residency is decided at the host points
// (at_layer, the prompt waves, finish_layer): victim choice skips slots with reads in flight,
// limbo slots are recycled only once their reads finished, and PUBLISH_PREFETCH publishes
// whichever prefetches happen to have completed. So IO timing leaks into routing. With
// PUBLISH_PREFETCH=0 and one-piece submissions the old policy applies: before each host point
// that changes the slot table the host waits for every queued and in-flight read. Speculative
// slots are then never published by timing (PUBLISH_PREFETCH=0), and every host decision sees
// finished reads only, so the residency each route sees is a function of the inputs and the
// call history alone. The cost: prefetches must land within the layer they were issued in
// (their overlap with that layer's compute remains). Split-turn and PUBLISH_PREFETCH=1 keep the
// overlap and accept timing-dependent moce routing (docs/design-notes.md).
bool settles_io(const SpeculatorOptions& o, const ExpertStream& stream) {
  return o.moce != MoceMode::Off && !stream.options().publish_prefetch && !o.split_turn;
}

GovernorOptions governor_options(GovernorOptions o, std::uint32_t n_layers, bool settles) {
  if (o.epoch == 0) o.epoch = n_layers;
  // Settled IO promises routing that is a function of the inputs: the cap may not depend on
  // timing either (prefetch_governor.h, "Deterministic mode").
  o.deterministic = o.deterministic || settles;
  return o;
}

}  // namespace

Speculator::Speculator(ExpertStream& stream, Recorder& recorder, const SpeculatorOptions& options)
    : stream_(stream),
      recorder_(recorder),
      L_(stream.layout()),
      opt_(options),
      settles_(settles_io(options, stream)),
      popularity_(L_.n_experts),
      governor_(governor_options(options.governor, L_.n_layers, settles_)) {
  const StreamStats& s = stream_.stats();
  gov_issued_ = s.spec_requests.load(std::memory_order_relaxed);
  gov_used_ = s.spec_hits.load(std::memory_order_relaxed);
}

std::uint32_t Speculator::cap(std::uint32_t layer) const {
  // The governor judges by wall time and by whether reads overlapped: IO timing. When the
  // Window settles for deterministic moce routing, that timing must not reach what is read.
  return opt_.prefetch_backoff && !settles_ ? governor_.cap_for(layer)
                                            : PrefetchGovernor::kUnlimited;
}

std::uint32_t Speculator::start_cap(std::uint32_t layer) const {
  return opt_.prefetch_backoff && !settles_ ? governor_.layer_cap(layer)
                                            : PrefetchGovernor::kUnlimited;
}

void Speculator::observe_start(std::uint32_t layer, std::uint64_t issued) {
  gov_issued_ += issued;  // not the next handshake's: that one's are for the layer after it
  if (!opt_.prefetch_backoff) return;
  std::lock_guard<std::mutex> lk(mu_);
  governor_.observe_start(layer, issued);
}

PrefetchGovernor Speculator::governor() const {
  std::lock_guard<std::mutex> lk(mu_);
  return governor_;
}

void Speculator::start_turn(ClientId client) {
  const std::uint32_t n = std::min(opt_.start_layers, L_.n_layers);
  if (n == 0) return;
  stream_.enter_layer(client, 0);  // until layer 0 runs, speculation evicts neither 0 nor 1 (I9)
  for (std::uint32_t layer = 0; layer < n; ++layer) {
    // Layer 0 is needed first: as many as one token uses. Later layers: a bounded head start.
    profile_ranked(layer, layer == 0 ? L_.top_k : L_.n_experts, profile_);
    if (layer == 0) hold_back_ranks(0, true, profile_);  // ranked best first too
    if (profile_.empty()) continue;
    // The governor judges these reads as the layer's (its per-layer cap bounds them too): they
    // are otherwise the largest single source of unused reads.
    const std::uint64_t before = stream_.stats().spec_requests.load(std::memory_order_relaxed);
    stream_.request(client, layer, profile_.data(), profile_.size(), ReadClass::Profile, {},
                    std::min(layer == 0 ? kUnlimitedReads : 32u, start_cap(layer)));
    observe_start(layer, stream_.stats().spec_requests.load(std::memory_order_relaxed) - before);
  }
}

bool Speculator::rank_gate() const {
  return opt_.prefetch_backoff && !settles_ && governor_.options().rank_precision > 0;
}

void Speculator::hold_back_ranks(std::uint32_t layer, bool scored,
                                 std::vector<std::int32_t>& ranked) {
  pending_.clear();
  pending_layer_ = kNoPending;
  if (!scored || !rank_gate()) return;
  pending_layer_ = layer;
  std::size_t kept = 0;
  for (std::size_t r = 0; r < ranked.size(); ++r) {
    const std::int32_t e = ranked[r];
    // Only an absent expert would be read: a resident one is only touched, and stays listed.
    const bool absent = stream_.where(layer, e) < 0;
    if (absent) pending_.push_back({std::uint32_t(r), e});
    if (absent && governor_.rank_gated(layer, std::uint32_t(r))) continue;
    ranked[kept++] = e;
  }
  ranked.resize(kept);
}

void Speculator::score_ranks(std::uint32_t layer, bool whole, const std::int32_t* urgent,
                             std::size_t n) {
  if (layer == pending_layer_ && whole && !pending_.empty()) {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& [rank, e] : pending_)
      governor_.observe_rank(layer, rank, std::find(urgent, urgent + n, e) != urgent + n);
  }
  pending_.clear();
  pending_layer_ = kNoPending;
}

void Speculator::settle(std::uint32_t layer, const InterruptCheck& interrupt) {
  if (!settles_) return;
  const auto t0 = Clock::now();
  stream_.settle(interrupt);
  const std::uint64_t dt = ns_since(t0);
  recorder_.add(layer, [&](LayerStats& st) { st.settle_ns += dt; });
}

void Speculator::fill(const ChunkPlan& p, std::uint32_t chunk, const std::int32_t* pred1,
                      const std::int32_t* pred2, bool first, bool last, HandshakeRequest& q) {
  q.publish = first;  // I2: completed prefetches of l+1..l+2, at the chunk's first host point
  score_ranks(p.layer, first && last && p.rows == 1, q.urgent, q.n_urgent);
  if (!last) return;  // the predictions queue behind the chunk's last urgent reads
  const std::uint32_t n = p.rows * L_.top_k;
  pred1_.clear();
  pred2_.clear();
  if (p.predict.next) {
    // Ordered by how many tokens chose each, ties in the router's order (best first): a capped
    // budget reads the likeliest.
    popularity_.rank(pred1, n, pred1_, Popularity::Ties::Given);
    recorder_.note_predicted(p.layer + 1, chunk, pred1_);
    hold_back_ranks(p.layer + 1, first && p.rows == 1, pred1_);
  }
  if (p.predict.two_layer) popularity_.rank(pred2, n, pred2_, Popularity::Ties::Given);
  profile_candidates(p.layer, p.rows, profile_);
  q.next_layer = pred1_.data();
  q.n_next_layer = pred1_.size();
  q.two_layer = pred2_.data();
  q.n_two_layer = pred2_.size();
  q.profile = profile_.data();
  q.n_profile = profile_.size();
  q.spec_budget = p.spec_budget;
  q.two_layer_max = p.two_layer_max;
}

Lookahead Speculator::useful(std::uint32_t layer, Lookahead l) const {
  if (l.next && all_resident_for_good(layer + 1)) l.next = false;
  if (l.two_layer && all_resident_for_good(layer + 2)) l.two_layer = false;
  return l;
}

bool Speculator::all_resident_for_good(std::uint32_t layer) const {
  // Slots are recycled only when no slot is free (take_slot), which an arena of every key's
  // slot never lacks for a key not yet resident: a published key of such an arena stays so.
  if (layer >= L_.n_layers || stream_.n_slots() < L_.n_keys()) return false;
  const std::uint32_t* smap = stream_.smap();
  for (std::uint32_t e = 0; e < L_.n_experts; ++e)
    if (smap_load(smap, layer * L_.n_experts + e) == kAbsent) return false;
  return true;
}

void Speculator::profile_ranked(std::uint32_t layer, std::size_t n,
                                std::vector<std::int32_t>& ranked) const {
  const std::uint32_t* counts = recorder_.profile_row(layer);
  ranked.clear();
  for (std::uint32_t e = 0; e < L_.n_experts; ++e)
    if (counts[e]) ranked.push_back(std::int32_t(e));
  std::stable_sort(ranked.begin(), ranked.end(), [&](std::int32_t a, std::int32_t b) {
    return counts[std::uint32_t(a)] > counts[std::uint32_t(b)];
  });
  if (ranked.size() > n) ranked.resize(n);
}

void Speculator::profile_candidates(std::uint32_t layer, std::uint32_t rows,
                                    std::vector<std::int32_t>& ranked) const {
  ranked.clear();
  if (opt_.lookahead || !opt_.profile_prefetch || layer + 1 >= L_.n_layers)
    return;  // I10: nothing beyond the last layer
  const std::size_t want = std::size_t(L_.top_k) * std::min(rows, kProfileRowsMax);
  profile_ranked(layer + 1, want, ranked);
  // Only experts the chunk is more likely than not to use: with p the share of tokens that
  // chose the expert, 1 - (1 - p)^rows >= 1/2. A popularity guess below that costs a read more
  // often than it saves one (on the synthetic driver, the unfiltered top_k tripled the bytes
  // read per decode token at a 25% arena for no speed).
  const std::uint32_t* counts = recorder_.profile_row(layer + 1);
  std::uint64_t choices = 0;
  for (std::uint32_t e = 0; e < L_.n_experts; ++e) choices += counts[e];
  const double tokens = double(choices) / L_.top_k;
  std::erase_if(ranked, [&](std::int32_t e) {
    const double p = std::min(1.0, double(counts[std::uint32_t(e)]) / tokens);
    return 1.0 - std::pow(1.0 - p, double(rows)) < 0.5;
  });
  // Speculative: behind urgent work in the IO queue, never waits for space, never evicts layer
  // `layer` or `layer + 1` (I9), within the handshake's budget.
}

Speculator::Watch Speculator::watch() const {
  const StreamStats& s = stream_.stats();
  const std::uint64_t started = s.spec_parts_started.load(std::memory_order_relaxed);
  const std::uint64_t done = s.spec_parts_done.load(std::memory_order_relaxed);
  return Watch{started > done ? started - done : 0, started};
}

bool Speculator::overlapped(const Watch& w) const {
  return w.in_flight_before > 0 ||
         stream_.stats().spec_parts_started.load(std::memory_order_relaxed) > w.started_before;
}

void Speculator::observe(bool decode, bool missed, bool contended, std::uint64_t wall_ns,
                         std::uint32_t layer) {
  const StreamStats& s = stream_.stats();
  const std::uint64_t issued = s.spec_requests.load(std::memory_order_relaxed);
  const std::uint64_t used = s.spec_hits.load(std::memory_order_relaxed);
  GovernorSample g;
  g.issued = issued - gov_issued_;
  g.used = used - gov_used_;
  g.missed = missed;
  g.contended = contended;
  g.wall_ns = wall_ns;
  g.decode = decode;
  g.layer = layer;
  gov_issued_ = issued;
  gov_used_ = used;
  if (!opt_.prefetch_backoff) return;
  std::lock_guard<std::mutex> lk(mu_);
  governor_.observe(g);
}

}  // namespace strata
