#include "exec/window.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <stdexcept>

#include "common/check.h"
#include "common/errors.h"
#include "common/timing.h"

namespace strata {
namespace {


// Times a host-work section twice: wall clock and the host thread's CPU time.
struct HostTimer {
  Clock::time_point wall = Clock::now();
  std::uint64_t cpu = thread_cpu_ns();
  void add_to(LayerStats& s) const {
    s.handshake_ns += ns_since(wall);
    s.handshake_cpu_ns += thread_cpu_ns() - cpu;
  }
};

GovernorOptions governor_options(GovernorOptions o, std::uint32_t n_layers) {
  if (o.epoch == 0) o.epoch = n_layers;
  return o;
}

Command cmd(Op op, std::uint32_t layer = 0, std::uint32_t rows = 0) {
  Command c{};
  c.op = op;
  c.layer = layer;
  c.rows = rows;
  return c;
}

Command event_cmd(Op op, SharedEvent& ev, std::uint64_t v) {
  Command c{};
  c.op = op;
  c.event = &ev;
  c.value = v;
  return c;
}

Command pass_cmd(Op op, std::uint32_t layer, std::uint32_t rows, Pass pass) {
  Command c = cmd(op, layer, rows);
  c.pass = pass;
  return c;
}

}  // namespace

Window::Window(ExpertStream& stream, std::unique_ptr<Backend> backend,
               const WindowOptions& options)
    : stream_(stream),
      backend_(std::move(backend)),
      opt_(options),
      L_(stream.layout()),
      routers_(stream.file().read_routers()),
      scratch_(stream, routers_.data()),
      governor_(governor_options(options.governor, L_.n_layers)) {
  if (opt_.max_rows == 0) throw EngineError(ErrorKind::Config, "max_rows must be positive");
  if (!(opt_.device_timeout_s > 0))
    throw EngineError(ErrorKind::Config, "device_timeout_s must be positive");
  if (opt_.moce.mode != MoceMode::Off) {
    if (!(opt_.moce.strength >= 0) || !std::isfinite(opt_.moce.strength))
      throw EngineError(ErrorKind::Config, "moce_strength must be finite and >= 0, got " +
                                               std::to_string(opt_.moce.strength));
    if (opt_.moce.keep_top > L_.top_k)
      throw EngineError(ErrorKind::Config, "moce_keep_top " + std::to_string(opt_.moce.keep_top) +
                                               " exceeds the pack's top_k " +
                                               std::to_string(L_.top_k));
  }
  // Determinism with moce (DESIGN section 6, PUBLISH_PREFETCH=0): see settle().
  settles_ = opt_.moce.mode != MoceMode::Off && !stream.options().publish_prefetch &&
             !opt_.split_turn;
  stats_.assign(L_.n_layers, LayerStats{});
  predicted_.assign(L_.n_layers, {});
  profile_.assign(std::size_t(L_.n_layers) * L_.n_experts, 0);
  const auto snap = stream_.stats().snapshot();
  gov_issued_ = std::uint64_t(snap.at("spec_requests"));
  gov_used_ = std::uint64_t(snap.at("spec_hits"));
  ensure_scratch(1);
}

Window::~Window() {
  backend_->abort_pending();
  backend_->synchronize();
  release_scratch();
}

void Window::release_scratch() {
  backend_->synchronize();  // no command may still read the buffers
  scratch_.release();
  x_ = out_ = nullptr;
  ids_ = pred1_ = pred2_ = wave_ = nullptr;
  wave_n_ = nullptr;
}

void Window::ensure_scratch(std::uint32_t rows) {
  if (rows <= scratch_.rows()) return;
  backend_->synchronize();  // nothing may run over the buffers being replaced
  scratch_.ensure(rows);
  const DeviceBuffers& b = scratch_.buffers();
  x_ = b.x;
  out_ = b.out;
  ids_ = b.ids;
  pred1_ = b.pred_ids[0];
  pred2_ = b.pred_ids[1];
  wave_ = b.wave;
  wave_n_ = b.wave_n;
  backend_->bind(b);
}

void Window::begin_turn() {
  if (in_turn_) throw std::logic_error("a turn is already open");
  in_turn_ = true;
  next_layer_ = 0;
  queue_start_layers();
}

void Window::end_turn() {
  if (!in_turn_) return;
  backend_->synchronize();
  stream_.end_turn();  // no device work in flight: protections end with the turn
  in_turn_ = false;
  next_layer_ = 0;
  // Without BUF_REUSE a prompt's scratch goes back to the system between turns; a decode-sized
  // one (a few rows) is not worth the churn.
  if (!opt_.prompt_buf_reuse && scratch_.rows() > opt_.decode_rows) release_scratch();
}

void Window::count_urgent(LayerStats& st, const RequestResult& r) const {
  st.hits += r.hits;
  st.misses += r.misses;
  st.bytes_read += std::uint64_t(r.misses) * L_.record_bytes;
}

void Window::reset_stats() { stats_.assign(L_.n_layers, LayerStats{}); }

void Window::set_profile(const std::vector<std::uint32_t>& counts) {
  if (counts.size() != profile_.size())
    throw EngineError(ErrorKind::Config, "profile has " + std::to_string(counts.size()) +
                                             " counts, expected n_layers * n_experts = " +
                                             std::to_string(profile_.size()));
  profile_ = counts;
}

void Window::queue_start_layers() {
  const std::uint32_t E = L_.n_experts;
  const std::uint32_t n = std::min(opt_.start_layers, L_.n_layers);
  if (n == 0) return;
  stream_.enter_layer(0);  // until layer 0 runs, speculation evicts neither layer 0 nor 1 (I9)
  for (std::uint32_t layer = 0; layer < n; ++layer) {
    // Layer 0 is needed first: as many as one token uses. Later layers: a bounded head start.
    std::vector<std::int32_t> ranked = profile_ranked(layer, layer == 0 ? L_.top_k : E);
    if (!ranked.empty())
      stream_.request(layer, ranked.data(), ranked.size(), ReadClass::Profile, {},
                      layer == 0 ? 0xFFFFFFFFu : 32u);
  }
}

std::vector<std::int32_t> Window::profile_ranked(std::uint32_t layer, std::size_t n) const {
  const std::uint32_t E = L_.n_experts;
  const std::uint32_t* counts = profile_.data() + std::size_t(layer) * E;
  std::vector<std::int32_t> ranked;
  for (std::uint32_t e = 0; e < E; ++e)
    if (counts[e]) ranked.push_back(std::int32_t(e));
  std::stable_sort(ranked.begin(), ranked.end(), [&](std::int32_t a, std::int32_t b) {
    return counts[std::uint32_t(a)] > counts[std::uint32_t(b)];
  });
  if (ranked.size() > n) ranked.resize(n);
  return ranked;
}

std::uint32_t Window::spec_cap() const {
  // The governor judges by wall time and by whether reads overlapped: IO timing. When the
  // Window settles for deterministic moce routing, that timing must not reach what is read.
  return opt_.prefetch_backoff && !settles_ ? governor_.cap() : PrefetchGovernor::kUnlimited;
}

std::uint32_t Window::limit_new(std::vector<std::int32_t>& experts, std::uint32_t layer,
                                std::uint32_t cap) const {
  if (cap == PrefetchGovernor::kUnlimited) return cap;
  // Published experts cost no read (the request only refreshes them), so they do not count.
  // An expert loading but not yet published counts: a conservative estimate, read lock-free.
  std::uint32_t fresh = 0;
  std::size_t keep = 0;
  for (; keep < experts.size(); ++keep) {
    const std::uint32_t key = layer * L_.n_experts + std::uint32_t(experts[keep]);
    if (stream_.smap_at(key) != kAbsent) continue;
    if (fresh == cap) break;
    ++fresh;
  }
  experts.resize(keep);
  return cap - fresh;
}

void Window::queue_profile(std::uint32_t layer, std::uint32_t rows, std::uint32_t cap,
                           const InterruptCheck& interrupt) {
  if (opt_.lookahead || !opt_.profile_prefetch || layer + 1 >= L_.n_layers || cap == 0)
    return;  // I10: nothing beyond the last layer
  const std::size_t want = std::size_t(L_.top_k) * std::min(rows, kProfileRowsMax);
  std::vector<std::int32_t> ranked = profile_ranked(layer + 1, want);
  // Only experts the chunk is more likely than not to use: with p the share of tokens that
  // chose the expert, 1 - (1 - p)^rows >= 1/2. A popularity guess below that costs a read more
  // often than it saves one (on the synthetic driver, the unfiltered top_k tripled the bytes
  // read per decode token at a 25% arena for no speed).
  const std::uint32_t* counts = profile_.data() + std::size_t(layer + 1) * L_.n_experts;
  std::uint64_t choices = 0;
  for (std::uint32_t e = 0; e < L_.n_experts; ++e) choices += counts[e];
  const double tokens = double(choices) / L_.top_k;
  std::erase_if(ranked, [&](std::int32_t e) {
    const double p = std::min(1.0, double(counts[std::uint32_t(e)]) / tokens);
    return 1.0 - std::pow(1.0 - p, double(rows)) < 0.5;
  });
  if (ranked.empty()) return;
  // Speculative: behind urgent work in the IO queue, never waits for space, never evicts layer
  // `layer` or `layer + 1` (I9), at most `cap` new reads.
  stream_.request(layer + 1, ranked.data(), ranked.size(), ReadClass::Profile, interrupt, cap);
}

Window::SpecWatch Window::watch_spec() const {
  const StreamStats& s = stream_.stats();
  const std::uint64_t started = s.spec_parts_started.load(std::memory_order_relaxed);
  const std::uint64_t done = s.spec_parts_done.load(std::memory_order_relaxed);
  return SpecWatch{started > done ? started - done : 0, started};
}

bool Window::spec_overlapped(const SpecWatch& w) const {
  return w.in_flight_before > 0 ||
         stream_.stats().spec_parts_started.load(std::memory_order_relaxed) > w.started_before;
}

void Window::observe_handshake(bool decode, bool missed, bool contended,
                               std::uint64_t wall_ns) {
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
  gov_issued_ = issued;
  gov_used_ = used;
  if (opt_.prefetch_backoff) governor_.observe(g);
}

std::vector<std::int32_t> Window::take_routes() {
  std::vector<std::int32_t> out;
  out.swap(routes_);
  return out;
}

std::uint32_t Window::wave_capacity() const {
  // Leave one top-k of room so that the next layer's prefetches are not all evicted.
  return stream_.n_slots() - L_.top_k;
}

void Window::moe(std::uint32_t layer, const float* x, std::uint32_t rows, float* out,
                 const InterruptCheck& interrupt) {
  if (layer >= L_.n_layers)
    throw std::out_of_range("layer " + std::to_string(layer) + " out of range [0, " +
                            std::to_string(L_.n_layers) + ")");
  if (!in_turn_) throw std::logic_error("Window.moe outside a turn");
  if (layer != next_layer_)
    throw std::logic_error("layer " + std::to_string(layer) + " called out of order: this turn " +
                           "expects layer " + std::to_string(next_layer_) + " next");
  if (rows == 0) return;
  const std::uint32_t H = L_.hidden;
  if (layer == 0) {  // a new pass over the model starts with these tokens
    pass_first_token_ = tokens_seen_;
    tokens_seen_ += rows;
  }
  try {
    std::vector<std::int32_t> chosen;
    std::vector<char> seen(L_.n_experts, 0);
    const std::uint32_t chunk_rows = std::min(rows, opt_.max_rows);
    ensure_scratch(chunk_rows);
    std::uint32_t chunk = 0;
    for (std::uint32_t r0 = 0; r0 < rows; r0 += opt_.max_rows, ++chunk) {
      const std::uint32_t n = std::min(opt_.max_rows, rows - r0);
      std::memcpy(x_, x + std::size_t(r0) * H, std::size_t(n) * H * 4);
      row0_ = r0;
      for (std::int32_t e : run_chunk(layer, chunk, n, interrupt))
        if (!seen[std::uint32_t(e)]) {
          seen[std::uint32_t(e)] = 1;
          chosen.push_back(e);
        }
      std::memcpy(out + std::size_t(r0) * H, out_, std::size_t(n) * H * 4);
    }
    after(layer, chosen, interrupt);
    stats_[layer].calls += 1;
    stats_[layer].tokens += rows;
  } catch (...) {
    // Abandon the call: the device skips what is queued, the turn ends, the stream stays usable.
    backend_->abort_pending();
    backend_->synchronize();
    // Aborting woke the device by signalling the value it waited for, which can be ahead of the
    // counters (waves encoded but never released). Resume past every value an event holds, so
    // no stale signal can release a later wait.
    for (SharedEvent* ev : {&routed_, &release1_, &release2_, &done_})
      seq_ = std::max(seq_, ev->value());
    for (SharedEvent* ev : {&wave_release_, &wave_done_})
      wave_seq_ = std::max(wave_seq_, ev->value());
    stream_.release_plan();
    stream_.end_turn();
    in_turn_ = false;
    next_layer_ = 0;
    throw;
  }
  next_layer_ = (layer + 1) % L_.n_layers;
}

std::vector<std::int32_t> Window::by_popularity(const std::int32_t* ids, std::uint32_t n) const {
  std::vector<std::uint32_t> count(L_.n_experts, 0);
  std::vector<std::int32_t> experts;
  for (std::uint32_t i = 0; i < n; ++i)
    if (count[std::uint32_t(ids[i])]++ == 0) experts.push_back(ids[i]);
  std::sort(experts.begin(), experts.end(), [&](std::int32_t a, std::int32_t b) {
    return count[std::uint32_t(a)] > count[std::uint32_t(b)] ||
           (count[std::uint32_t(a)] == count[std::uint32_t(b)] && a < b);
  });
  return experts;
}

bool Window::predicts2(std::uint32_t layer, bool decode) const {
  return opt_.lookahead && layer + 2 < L_.n_layers &&  // I10: the last two layers skip it
         (decode ? opt_.decode_prefetch2 : opt_.prompt_pred2);
}

std::vector<std::int32_t> Window::predictions2(std::uint32_t layer, std::uint32_t rows,
                                               bool decode) {
  if (!predicts2(layer, decode)) return {};
  return by_popularity(pred2_, rows * L_.top_k);  // ordered by how many tokens chose each
}

std::vector<std::int32_t> Window::predictions(std::uint32_t layer, std::uint32_t chunk,
                                              std::uint32_t rows) {
  if (!opt_.lookahead || layer + 1 >= L_.n_layers) return {};  // I10
  std::vector<std::int32_t> p = by_popularity(pred1_, rows * L_.top_k);
  auto& slot = predicted_[layer + 1];
  if (slot.size() <= chunk) slot.resize(chunk + 1);
  slot[chunk] = p;
  return p;
}

void Window::record_actual(std::uint32_t layer, std::uint32_t chunk,
                           const std::vector<std::int32_t>& chosen) {
  auto& slot = predicted_[layer];
  if (chunk >= slot.size() || slot[chunk].empty()) return;
  std::vector<char> actual(L_.n_experts, 0);
  for (std::int32_t e : chosen) actual[std::uint32_t(e)] = 1;
  std::uint64_t correct = 0;
  for (std::int32_t e : slot[chunk]) correct += actual[std::uint32_t(e)];
  LayerStats& s = stats_[layer];
  s.pred_correct += correct;
  s.pred_predicted += slot[chunk].size();
  s.pred_actual += chosen.size();
  slot[chunk].clear();
}

void Window::wait_device(SharedEvent& ev, std::uint64_t v, const InterruptCheck& interrupt) {
  if (!ev.wait_for(v, std::chrono::duration<double>(opt_.device_timeout_s), interrupt))
    throw EngineError(ErrorKind::Timeout, "the " + backend_->name() +
                                              " device did not reach the handshake within " +
                                              std::to_string(opt_.device_timeout_s) + " s");
  std::string err = backend_->take_device_error();
  if (!err.empty()) throw std::logic_error(err);
}

void Window::stall_for(std::uint32_t layer, const std::vector<std::int32_t>& experts,
                       const InterruptCheck& interrupt) {
  auto t0 = Clock::now();
  stream_.wait(layer, experts.data(), experts.size(), interrupt);
  stats_[layer].stall_ns += ns_since(t0);
}

// With moce on, routing reads residency, and residency is decided at the host points
// (at_layer, the prompt waves, finish_layer): victim choice skips slots with reads in flight,
// limbo slots are recycled only once their reads finished, and PUBLISH_PREFETCH publishes
// whichever prefetches happen to have completed. So IO timing leaks into routing. With
// PUBLISH_PREFETCH=0 and one-piece submissions the old policy applies: before each host point
// that changes the slot table the host waits for every queued and in-flight read. Speculative
// slots are then never published by timing (PUBLISH_PREFETCH=0), and every host decision sees
// finished reads only, so the residency each route sees is a function of the inputs and the call
// history alone. The cost: prefetches must land within the layer they were issued in (their
// overlap with that layer's compute remains). Split-turn and PUBLISH_PREFETCH=1 keep the
// overlap and accept timing-dependent moce routing.
void Window::settle(std::uint32_t layer, const InterruptCheck& interrupt) {
  if (!settles_) return;
  auto t0 = Clock::now();
  stream_.settle(interrupt);
  stats_[layer].settle_ns += ns_since(t0);
}

void Window::note_moce(std::uint32_t layer, std::uint32_t rows) {
  if (opt_.moce.mode == MoceMode::Off) return;
  const DeviceBuffers& b = scratch_.buffers();
  LayerStats& st = stats_[layer];
  for (std::uint32_t t = 0; t < rows; ++t) {  // in row order: the same sum every run
    st.moce_moved += double(b.moce_moved[t]);
    st.moce_changed += b.moce_changed[t];
  }
  route_resident_.assign(b.route_resident, b.route_resident + L_.n_experts);
  route_layer_ = layer;
}

void Window::after(std::uint32_t layer, const std::vector<std::int32_t>& chosen,
                   const InterruptCheck& interrupt) {
  settle(layer, interrupt);
  HostTimer timer;
  // I4: layer+1's router may already run; I7: unchosen predictions of this layer to limbo.
  stream_.finish_layer(layer, chosen.data(), chosen.size());
  timer.add_to(stats_[layer]);
}

std::vector<std::int32_t> Window::run_chunk(std::uint32_t layer, std::uint32_t chunk,
                                            std::uint32_t rows, const InterruptCheck& interrupt) {
  const Clock::time_point chunk_start = Clock::now();  // the governor's trials compare this
  const std::uint32_t k = L_.top_k;
  const std::uint64_t v = ++seq_;
  const std::uint32_t cap = wave_capacity();
  const bool decode = rows <= opt_.decode_rows && rows * k <= cap;
  const bool predict = opt_.lookahead && layer + 1 < L_.n_layers;
  const std::uint32_t max_waves =
      decode ? 0 : (std::min(L_.n_experts, rows * k) + cap - 1) / cap;
  const std::uint64_t first_wave = wave_seq_ + 1;

  // ---- submission: route (+ predict), then, in one piece, every step behind an event wait ----
  Command route = cmd(Op::Route, layer, rows);
  route.moce = opt_.moce;
  std::vector<Command> s1 = {route};
  if (predict) {
    Command c = cmd(Op::RoutePredict, layer + 1, rows);
    c.distance = 1;
    s1.push_back(c);
  }
  if (predicts2(layer, decode)) {  // router scratch is reused; only the id buffer is its own
    Command c = cmd(Op::RoutePredict, layer + 2, rows);
    c.distance = 2;
    s1.push_back(c);
  }
  s1.push_back(event_cmd(Op::Signal, routed_, v));
  if (!opt_.split_turn) {
    if (decode) {
      s1.push_back(event_cmd(Op::Wait, release1_, v));
      s1.push_back(cmd(Op::Plan, layer, rows));
      s1.push_back(pass_cmd(Op::GateUp, layer, rows, Pass::Resident));
      s1.push_back(pass_cmd(Op::Down, layer, rows, Pass::Resident));
      s1.push_back(event_cmd(Op::Wait, release2_, v));
      s1.push_back(pass_cmd(Op::GateUp, layer, rows, Pass::Missing));
      s1.push_back(pass_cmd(Op::Down, layer, rows, Pass::Missing));
    } else {
      for (std::uint32_t w = 0; w < max_waves; ++w) {
        s1.push_back(event_cmd(Op::Wait, wave_release_, first_wave + w));
        s1.push_back(cmd(Op::MoeMM, layer, rows));
        s1.push_back(event_cmd(Op::Signal, wave_done_, first_wave + w));
      }
    }
    s1.push_back(cmd(Op::Combine, layer, rows));
    s1.push_back(event_cmd(Op::Signal, done_, v));
  }
  backend_->submit(std::move(s1));
  wait_device(routed_, v, interrupt);
  note_moce(layer, rows);
  settle(layer, interrupt);

  // ---- at_layer(l): the host reads the ids and makes the experts come ----
  HostTimer at_layer;
  std::vector<std::int32_t> chosen = by_popularity(ids_, rows * k);
  for (std::uint32_t i = 0; i < rows * k; ++i)  // learn the popularity profile online
    ++profile_[std::size_t(layer) * L_.n_experts + std::uint32_t(ids_[i])];
  if (opt_.record_routes)
    for (std::uint32_t i = 0; i < rows * k; ++i)
      routes_.insert(routes_.end(), {std::int32_t(pass_first_token_ + row0_ + i / k),
                                     std::int32_t(layer), ids_[i]});
  record_actual(layer, chunk, chosen);
  LayerStats& st = stats_[layer];
  const std::uint32_t n_waves =
      decode ? 1 : std::uint32_t((chosen.size() + cap - 1) / cap);
  STRATA_ASSERT(decode || n_waves <= max_waves, "waves fit the encoded submission");
  const bool multi = n_waves > 1;

  if (decode) {
    std::vector<std::int32_t> predicted = predictions(layer, chunk, rows);
    std::vector<std::int32_t> predicted2 = predictions2(layer, rows, true);
    std::uint32_t cap = spec_cap();  // the governor's, shared by every speculative class
    cap = limit_new(predicted, layer + 1, cap);
    const std::uint32_t cap2 = limit_new(predicted2, layer + 2, cap);
    const SpecWatch watch = watch_spec();
    AtLayerResult r = stream_.at_layer(layer, chosen.data(), chosen.size(), predicted.data(),
                                       predicted.size(), interrupt, predicted2.data(),
                                       predicted2.size());
    count_urgent(st, r.urgent);
    at_layer.add_to(st);
    if (opt_.split_turn)
      backend_->submit({cmd(Op::Plan, layer, rows),
                        pass_cmd(Op::GateUp, layer, rows, Pass::Resident),
                        pass_cmd(Op::Down, layer, rows, Pass::Resident)});
    else
      release1_.signal(v);
    // With the device released: the fallback costs the device nothing while it waits.
    queue_profile(layer, rows, cap2, interrupt);
    stall_for(layer, chosen, interrupt);  // the resident pass runs meanwhile
    const bool missed = r.urgent.misses > 0;
    const bool contended = missed && spec_overlapped(watch);
    if (opt_.split_turn)
      backend_->submit({pass_cmd(Op::GateUp, layer, rows, Pass::Missing),
                        pass_cmd(Op::Down, layer, rows, Pass::Missing),
                        cmd(Op::Combine, layer, rows), event_cmd(Op::Signal, done_, v)});
    else
      release2_.signal(v);
    wait_device(done_, v, interrupt);
    observe_handshake(true, missed, contended, ns_since(chunk_start));
    return chosen;
  }

  // Prompt: every expert of a wave is resident before the device may start it.
  at_layer.add_to(st);
  bool missed = false, contended = false;
  for (std::uint32_t w = 0; w < n_waves; ++w) {
    auto begin = chosen.begin() + std::ptrdiff_t(w) * cap;
    auto end = chosen.begin() + std::ptrdiff_t(std::min<std::size_t>((w + 1) * cap, chosen.size()));
    std::vector<std::int32_t> wave(begin, end);
    HostTimer wave_timer;
    stream_.enter_layer(layer, wave.data(), wave.size());  // finished waves may make room
    const SpecWatch watch = watch_spec();
    RequestResult r = stream_.request(layer, wave.data(), wave.size(), ReadClass::Urgent, interrupt);
    count_urgent(st, r);
    if (w == 0) stream_.publish(layer);
    if (w + 1 == n_waves) {  // predictions queue behind the last wave's reads
      std::uint32_t cap = spec_cap();  // the governor's, shared by every speculative class
      std::vector<std::int32_t> p = predictions(layer, chunk, rows);
      if (!p.empty() && cap > 0) {
        RequestResult r1 =
            stream_.request(layer + 1, p.data(), p.size(), ReadClass::Pred1, interrupt, cap);
        if (cap != PrefetchGovernor::kUnlimited) cap -= std::min(cap, r1.spec_started);
      }
      std::vector<std::int32_t> p2 = predictions2(layer, rows, false);
      if (!p2.empty() && cap > 0)
        stream_.request(layer + 2, p2.data(), p2.size(), ReadClass::Pred2, interrupt,
                        std::min(cap, opt_.pred2_max));
      queue_profile(layer, rows, cap, interrupt);
    }
    wave_timer.add_to(st);
    stall_for(layer, wave, interrupt);
    if (r.misses > 0) {
      missed = true;
      contended = contended || spec_overlapped(watch);
    }
    std::vector<std::uint8_t> resident(wave.size());
    if (multi) stream_.plan(layer, wave.data(), wave.size(), resident.data());  // I8 by pins
    std::copy(wave.begin(), wave.end(), wave_);
    wave_n_[0] = std::uint32_t(wave.size());
    const std::uint64_t wv = ++wave_seq_;
    if (opt_.split_turn)
      backend_->submit({cmd(Op::MoeMM, layer, rows), event_cmd(Op::Signal, wave_done_, wv)});
    else
      wave_release_.signal(wv);
    wait_device(wave_done_, wv, interrupt);
    if (multi) stream_.release_plan();
  }
  st.waves += n_waves;
  if (opt_.split_turn) {
    backend_->submit({cmd(Op::Combine, layer, rows), event_cmd(Op::Signal, done_, v)});
  } else {
    for (std::uint32_t w = n_waves; w < max_waves; ++w) {  // encoded waves this chunk needs not
      wave_n_[0] = 0;
      const std::uint64_t wv = ++wave_seq_;
      wave_release_.signal(wv);
      wait_device(wave_done_, wv, interrupt);
    }
  }
  wait_device(done_, v, interrupt);
  observe_handshake(false, missed, contended, ns_since(chunk_start));
  return chosen;
}

}  // namespace strata
