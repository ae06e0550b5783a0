#include "exec/window.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <exception>
#include <stdexcept>
#include <utility>

#include "common/check.h"
#include "common/errors.h"
#include "common/timing.h"
#include "pack/weights.h"
#include "residency/slot.h"
#include "residency/smap.h"

namespace strata {

// Times a host-work section twice: wall clock and the host thread's CPU time.
struct HostTimer {
  Clock::time_point wall = Clock::now();
  std::uint64_t cpu = thread_cpu_ns();
  void add_to(LayerStats& s, std::uint64_t wall_ns, std::uint64_t cpu_ns) const {
    s.handshake_ns += wall_ns;
    s.handshake_cpu_ns += cpu_ns;
  }
  std::uint64_t wall_ns() const { return ns_since(wall); }
  std::uint64_t cpu_ns() const { return thread_cpu_ns() - cpu; }
};

namespace {

// Determinism with moce (docs/design-notes.md, PUBLISH_PREFETCH=0): see settle().
bool settles_io(const WindowOptions& o, const ExpertStream& stream) {
  return o.moce.mode != MoceMode::Off && !stream.options().publish_prefetch && !o.split_turn;
}

GovernorOptions governor_options(GovernorOptions o, std::uint32_t n_layers, bool settles) {
  if (o.epoch == 0) o.epoch = n_layers;
  // Settled IO promises routing that is a function of the inputs: the cap may not depend on
  // timing either (prefetch_governor.h, "Deterministic mode").
  o.deterministic = o.deterministic || settles;
  return o;
}

}  // namespace

Capability route_capability(const PackLayout& layout, const MoceParams& moce) {
  return Capability{Op::Route, &layout, Arithmetic::Float32, moce.mode};
}

// ---- admission: one driving call at a time, on the turn owner's thread ------------------------

class Window::Call {
 public:
  // closed_ok: report a closed Window by admitted() == false instead of throwing.
  explicit Call(Window& w, bool closed_ok = false) : w_(w) {
    std::lock_guard<std::mutex> lk(w_.door_mu_);
    if (w_.life_ != Lifecycle::Open) {
      if (closed_ok) return;
      throw EngineError(ErrorKind::Closed, "Window is closed");
    }
    const auto self = std::this_thread::get_id();
    if (w_.turn_ != TurnKind::None && w_.owner_ != self)
      throw EngineError(ErrorKind::Turn,
                        "this Window's turn belongs to another thread (two threads cannot drive "
                        "one Window; use one Window per thread or sequence)");
    if (w_.busy_)
      throw EngineError(ErrorKind::Turn, "Window called from two threads at once; use one per thread");
    w_.busy_ = true;
    w_.busy_thread_ = self;
    admitted_ = true;
  }
  ~Call() {
    if (!admitted_) return;
    {
      std::lock_guard<std::mutex> lk(w_.door_mu_);
      w_.busy_ = false;
      w_.busy_thread_ = {};
    }
    w_.door_cv_.notify_all();
  }
  Call(const Call&) = delete;
  Call& operator=(const Call&) = delete;
  bool admitted() const { return admitted_; }

 private:
  Window& w_;
  bool admitted_ = false;
};

Window::Window(ExpertStream& stream, std::unique_ptr<Backend> backend,
               const WindowOptions& options)
    : stream_(stream),
      backend_(std::move(backend)),
      backend_name_(backend_ ? backend_->name() : ""),
      host_spin_(backend_ ? backend_->host_spin() : std::chrono::microseconds(0)),
      spin_routed_(host_spin_),
      spin_wave_(host_spin_),
      spin_done_(host_spin_),
      opt_(options),
      L_(stream.layout()),
      routers_(stream.file().read_routers()),
      scratch_(stream, routers_.data()),
      rules_(rules()),
      governor_(governor_options(options.governor, L_.n_layers, settles_io(options, stream))) {
  if (!backend_) throw EngineError(ErrorKind::Config, "Window needs a backend");
  // The capabilities a call may need, asked once: the expert passes' arithmetic (a routed call
  // chooses it) and the route's moce mode (this Window's own).
  class_arithmetic_why_.resize(L_.classes.size());
  for (Arithmetic a : {Arithmetic::Float32, Arithmetic::MlxBfloat16, Arithmetic::MlxFloat32}) {
    arithmetic_why_[std::size_t(a)] =
        backend_->unsupported(Capability{Op::MoeMM, &L_, a, MoceMode::Off}).value_or("");
    for (std::size_t c = 0; c < L_.classes.size(); ++c) {
      Capability one{Op::MoeMM, &L_, a, MoceMode::Off};
      one.format_class = std::int32_t(c);
      class_arithmetic_why_[c][std::size_t(a)] = backend_->unsupported(one).value_or("");
    }
  }
  device_io_why_ =
      backend_->unsupported(Capability{Op::Combine, &L_, Arithmetic::Float32, MoceMode::Off,
                                       Io::Device})
          .value_or("");
  Capability per_entry{Op::Combine, &L_, Arithmetic::Float32, MoceMode::Off};
  per_entry.per_entry = true;
  per_entry_why_ = backend_->unsupported(per_entry).value_or("");
  completes_async_ = device_io_why_.empty() && backend_->completes_async();
  if (auto why = backend_->unsupported(route_capability(L_, options.moce)))
    throw EngineError(ErrorKind::Config, "backend '" + backend_name_ + "': " + *why);
  if (opt_.max_rows == 0) throw EngineError(ErrorKind::Config, "max_rows must be positive");
  if (!(opt_.device_timeout_s > 0) || !std::isfinite(opt_.device_timeout_s))
    throw EngineError(ErrorKind::Config, "device_timeout_s must be positive and finite");
  if (opt_.moce.mode != MoceMode::Off) {
    if (!(opt_.moce.strength >= 0) || !std::isfinite(opt_.moce.strength))
      throw EngineError(ErrorKind::Config, "moce_strength must be finite and >= 0, got " +
                                               std::to_string(opt_.moce.strength));
    if (opt_.moce.keep_top > L_.top_k)
      throw EngineError(ErrorKind::Config, "moce_keep_top " + std::to_string(opt_.moce.keep_top) +
                                               " exceeds the pack's top_k " +
                                               std::to_string(L_.top_k));
  }
  settles_ = settles_io(opt_, stream);
  stats_.assign(L_.n_layers, LayerStats{});
  predicted_.assign(L_.n_layers, {});
  buf_.votes.assign(L_.n_experts, 0);
  buf_.seen.assign(L_.n_experts, 0);
  buf_.actual.assign(L_.n_experts, 0);
  buf_.batch_marks.assign(L_.n_experts, 0);
  buf_.slot_of.assign(L_.n_experts, kAbsent);
  profile_.assign(std::size_t(L_.n_layers) * L_.n_experts, 0);
  const auto snap = stream_.stats().snapshot();
  gov_issued_ = std::uint64_t(snap.at("spec_requests"));
  gov_used_ = std::uint64_t(snap.at("spec_hits"));
  ensure_scratch(1);
  // The backend's hook at IO completion (a device copy before publication: docs/cuda.md), once
  // its buffers are bound; removed again if the registration below fails.
  if (RecordObserver* o = backend_->record_observer()) observer_ = stream_.add_observer(o);
  // Last: once registered, the stream's close() may call close() on this Window.
  try {
    client_ = stream_.open_client([this] { close(); });
  } catch (...) {
    if (observer_) stream_.remove_observer(*observer_);
    throw;
  }
}

Window::~Window() {
  close();
  stream_.close_client(client_);  // waits while the stream's close() is inside our hook
}

bool Window::closed() const {
  std::lock_guard<std::mutex> lk(door_mu_);
  return life_ != Lifecycle::Open;
}

bool Window::in_turn() const {
  std::lock_guard<std::mutex> lk(door_mu_);
  return turn_ != TurnKind::None;
}

std::uint32_t Window::next_layer() const {
  std::lock_guard<std::mutex> lk(door_mu_);
  return next_layer_;
}

bool Window::completion_pending() const {
  std::lock_guard<std::mutex> lk(door_mu_);
  return completion_ != Completion::Done;
}

// ---- the pending completion: a call that returned with its kernels queued (I4) ---------------

void Window::defer_chunk() {
  std::lock_guard<std::mutex> lk(door_mu_);
  STRATA_ASSERT(completion_ == Completion::Done || completion_ == Completion::ChunkPending,
                "only the call in progress has queued chunks");
  completion_ = Completion::ChunkPending;
}

void Window::defer_completion() {
  std::lock_guard<std::mutex> lk(door_mu_);
  STRATA_ASSERT(completion_ == Completion::ChunkPending, "a queued call's last chunk is queued");
  completion_ = Completion::LayerPending;
}

bool Window::keep_queued_chunk(const ChunkPlan& p) {
  if (completion_ != Completion::ChunkPending) return false;
  STRATA_ASSERT(p.kind == CallKind::Routed, "only a routed call's chunks return queued");
  // Routed: the waves encoded are the waves the chunk runs (plan_chunk counts its experts).
  if (p.executor == Executor::Decode || p.max_waves == 1) {
    // buf_.seen marks the call's experts so far (the earlier chunks', all still protected);
    // buf_.batch_marks, kept zero, this chunk's.
    std::size_t together = buf_.call_chosen.size();
    const std::size_t n = std::size_t(p.rows) * L_.top_k;
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t e = std::uint32_t(ids_[i]);
      if (!buf_.seen[e] && !buf_.batch_marks[e]) {
        buf_.batch_marks[e] = 1;
        ++together;
      }
    }
    for (std::size_t i = 0; i < n; ++i) buf_.batch_marks[std::uint32_t(ids_[i])] = 0;
    if (together <= p.wave_capacity) return true;
  }
  drain();  // the earlier chunks' kernels finished: their protections may go
  raise_device_error();
  return false;
}

void Window::defer_turn_end() {
  pending_turn_prompt_ = std::exchange(turn_prompt_, false);
  std::lock_guard<std::mutex> lk(door_mu_);
  STRATA_ASSERT(completion_ == Completion::LayerPending, "only a pending layer defers the turn end");
  completion_ = Completion::TurnEndPending;
  turn_ = TurnKind::None;  // the Window's turn is over; the stream's ends at the retire
  owner_ = {};
  next_layer_ = 0;
}

Window::Completion Window::drain() {
  backend_->synchronize();  // every kernel submitted has finished
  std::lock_guard<std::mutex> lk(door_mu_);
  return std::exchange(completion_, Completion::Done);
}

void Window::retire_completion() {
  if (!completion_pending()) return;
  // The provable point: every kernel of the last call has finished.
  if (drain() == Completion::TurnEndPending)
    end_turn_in_stream(std::exchange(pending_turn_prompt_, false));
  // A fault the drained kernels met (an asynchronous one shows only at the drain) fails the
  // call that retires them: their output was already the caller's, so it must not go unsaid.
  raise_device_error();
}

void Window::raise_device_error() {
  std::string err = backend_->take_device_error();
  if (!err.empty()) throw EngineError(ErrorKind::Device, err);
}

void Window::close() {
  {
    std::unique_lock<std::mutex> lk(door_mu_);
    if (life_ == Lifecycle::Closed) return;
    if (busy_ && busy_thread_ == std::this_thread::get_id())
      throw EngineError(ErrorKind::Turn, "Window.close() from inside one of its own calls");
    if (life_ == Lifecycle::Closing) {  // another thread is closing: wait until it is done
      door_cv_.wait(lk, [&] { return life_ == Lifecycle::Closed; });
      return;
    }
    life_ = Lifecycle::Closing;  // no call is admitted from now on
    door_cv_.wait(lk, [&] { return !busy_; });  // the layer in flight finishes (its own bounds)
    busy_ = true;
    busy_thread_ = std::this_thread::get_id();
  }
  teardown();
  {
    std::lock_guard<std::mutex> lk(door_mu_);
    life_ = Lifecycle::Closed;
    turn_ = TurnKind::None;  // the owner's next call raises Closed
    next_layer_ = 0;
    busy_ = false;
    busy_thread_ = {};
  }
  door_cv_.notify_all();
}

void Window::teardown() {
  // First, so that no new IO completion calls into the backend; returns once no IO thread is
  // inside its observer (a device copy in progress finishes), so the backend may then go.
  if (observer_) stream_.remove_observer(*observer_);
  observer_.reset();
  backend_->abort_pending();
  drain();  // no device work in flight from here; a pending one's protections end just below
  pending_turn_prompt_ = false;
  stream_.release_client(client_);  // the turn's protections and pins end with it
  backend_.reset();  // joins the device thread and its worker pool
  scratch_.release();
  scratch_bytes_.store(0, std::memory_order_relaxed);
  x_ = out_ = nullptr;
  ids_ = pred1_ = pred2_ = wave_ = nullptr;
  wave_n_ = nullptr;
  std::vector<float>().swap(routers_);
}

void Window::release_scratch() {
  backend_->synchronize();  // no command may still read the buffers
  scratch_.release();
  bound_ = false;
  scratch_bytes_.store(0, std::memory_order_relaxed);
  x_ = out_ = weights_ = nullptr;
  ids_ = pred1_ = pred2_ = wave_ = nullptr;
  wave_n_ = nullptr;
}

void Window::ensure_scratch(std::uint32_t rows) {
  if (rows <= scratch_.rows() && bound_) return;
  backend_->synchronize();  // nothing may run over the buffers being replaced
  bound_ = false;           // until the backend has the new ones
  scratch_.ensure(rows);
  scratch_bytes_.store(scratch_.bytes(), std::memory_order_relaxed);
  const DeviceBuffers& b = scratch_.buffers();
  x_ = b.x;
  out_ = b.out;
  ids_ = b.ids;
  pred1_ = b.pred_ids[0];
  pred2_ = b.pred_ids[1];
  wave_ = b.wave;
  wave_n_ = b.wave_n;
  weights_ = b.weights;
  // A backend's set-up (device scratch, host registration) can fail: a Device error naming the
  // backend, the call abandoned, the stream usable; the next call binds again (bound_).
  try {
    backend_->bind(b);
  } catch (const EngineError&) {
    throw;
  } catch (const std::exception& e) {
    throw EngineError(ErrorKind::Device,
                      "the " + backend_name_ + " backend could not take its buffers for " +
                          std::to_string(scratch_.rows()) + " rows: " + e.what());
  }
  bound_ = true;
}

void Window::begin_turn() {
  Call call(*this);
  bool implicit_open = false;
  {
    std::lock_guard<std::mutex> lk(door_mu_);
    if (turn_ == TurnKind::Explicit) throw EngineError(ErrorKind::Turn, "a turn is already open");
    implicit_open = turn_ == TurnKind::Implicit;  // this thread's (Call checked the owner)
  }
  if (implicit_open) finish_turn();
  retire_completion();  // a turn that ended with its kernels queued ends in the stream first
  {
    std::lock_guard<std::mutex> lk(door_mu_);
    turn_ = TurnKind::Explicit;
    owner_ = std::this_thread::get_id();
    next_layer_ = 0;
  }
  queue_start_layers();
}

void Window::end_turn() {
  {
    std::lock_guard<std::mutex> lk(door_mu_);
    if (life_ != Lifecycle::Open) return;
    // Nothing to end: no turn, and none whose end the stream still waits for.
    if (turn_ == TurnKind::None && completion_ == Completion::Done) return;
  }
  Call call(*this, /*closed_ok=*/true);  // Turn error from a thread that does not own the turn
  if (!call.admitted()) return;          // closed meanwhile: close() ended the turn
  bool open = false;
  {
    std::lock_guard<std::mutex> lk(door_mu_);
    open = turn_ != TurnKind::None;
  }
  if (open)
    finish_turn();
  else
    retire_completion();  // the implicit turn ended with its kernels queued: end it now
}

void Window::finish_turn() {
  // This turn's last call may have returned with its kernels queued. A device error they met
  // is thrown once the turn has ended all the same (the stream stays usable, nothing stays open).
  std::exception_ptr fault;
  try {
    retire_completion();
  } catch (...) {
    fault = std::current_exception();
  }
  // The retire left nothing pending: an open turn owes the stream no turn end.
  [[maybe_unused]] const Completion was = drain();
  STRATA_ASSERT(was == Completion::Done, "an open turn owes the stream no turn end");
  {
    std::lock_guard<std::mutex> lk(door_mu_);
    turn_ = TurnKind::None;
    owner_ = {};
    next_layer_ = 0;
  }
  end_turn_in_stream(std::exchange(turn_prompt_, false));
  if (fault) std::rethrow_exception(fault);
}

void Window::end_turn_in_stream(bool prompt) {
  STRATA_ASSERT(completion_ == Completion::Done, "no kernel of this Window is in flight");
  stream_.end_turn(client_);  // no device work in flight: protections end with the turn
  // Without BUF_REUSE a prompt's scratch goes back to the system between turns; a decode-path
  // one (a few rows, or a decode batch's at most decode_batch_rows) is not worth the churn.
  if (!opt_.prompt_buf_reuse && prompt && scratch_.rows() > opt_.decode_rows) release_scratch();
}

void Window::count_urgent(std::uint32_t layer, const RequestResult& r) {
  with_stats(layer, [&](LayerStats& st) {
    st.hits += r.hits;
    st.misses += r.misses;
    st.bytes_read += std::uint64_t(r.misses) * L_.record_bytes;
  });
}

void Window::add_host_time(std::uint32_t layer, const HostTimer& t) {
  const std::uint64_t wall = t.wall_ns(), cpu = t.cpu_ns();
  with_stats(layer, [&](LayerStats& st) { t.add_to(st, wall, cpu); });
}

void Window::reset_stats() {
  std::lock_guard<std::mutex> lk(stats_mu_);
  stats_.assign(L_.n_layers, LayerStats{});
}

std::vector<LayerStats> Window::layer_stats() const {
  std::lock_guard<std::mutex> lk(stats_mu_);
  return stats_;
}

std::vector<std::uint32_t> Window::profile() const {
  std::lock_guard<std::mutex> lk(stats_mu_);
  return profile_;
}

std::vector<std::uint8_t> Window::route_resident() const {
  std::lock_guard<std::mutex> lk(stats_mu_);
  return route_resident_;
}

std::int64_t Window::route_layer() const {
  std::lock_guard<std::mutex> lk(stats_mu_);
  return route_layer_;
}

PrefetchGovernor Window::governor() const {
  std::lock_guard<std::mutex> lk(stats_mu_);
  return governor_;
}

void Window::set_profile(const std::vector<std::uint32_t>& counts) {
  const std::size_t want = std::size_t(L_.n_layers) * L_.n_experts;
  if (counts.size() != want)
    throw EngineError(ErrorKind::Config, "profile has " + std::to_string(counts.size()) +
                                             " counts, expected n_layers * n_experts = " +
                                             std::to_string(want));
  Call call(*this);  // the driving call reads profile_ without a lock: not while one runs
  std::lock_guard<std::mutex> lk(stats_mu_);
  profile_ = counts;
}

void Window::queue_start_layers() {
  const std::uint32_t E = L_.n_experts;
  const std::uint32_t n = std::min(opt_.start_layers, L_.n_layers);
  if (n == 0) return;
  STRATA_ASSERT(completion_ == Completion::Done, "no queued kernel may lose its protections");
  stream_.enter_layer(client_, 0);  // until layer 0 runs, speculation evicts neither 0 nor 1 (I9)
  for (std::uint32_t layer = 0; layer < n; ++layer) {
    // Layer 0 is needed first: as many as one token uses. Later layers: a bounded head start.
    std::vector<std::int32_t> ranked;
    profile_ranked(layer, layer == 0 ? L_.top_k : E, ranked);
    if (!ranked.empty())
      stream_.request(client_, layer, ranked.data(), ranked.size(), ReadClass::Profile, {},
                      layer == 0 ? kUnlimitedReads : 32u);
  }
}

void Window::profile_ranked(std::uint32_t layer, std::size_t n,
                            std::vector<std::int32_t>& ranked) const {
  const std::uint32_t E = L_.n_experts;
  const std::uint32_t* counts = profile_.data() + std::size_t(layer) * E;
  ranked.clear();
  for (std::uint32_t e = 0; e < E; ++e)
    if (counts[e]) ranked.push_back(std::int32_t(e));
  std::stable_sort(ranked.begin(), ranked.end(), [&](std::int32_t a, std::int32_t b) {
    return counts[std::uint32_t(a)] > counts[std::uint32_t(b)];
  });
  if (ranked.size() > n) ranked.resize(n);
}

std::uint32_t Window::spec_cap() const {
  // The governor judges by wall time and by whether reads overlapped: IO timing. When the
  // Window settles for deterministic moce routing, that timing must not reach what is read.
  return opt_.prefetch_backoff && !settles_ ? governor_.cap() : PrefetchGovernor::kUnlimited;
}

void Window::profile_candidates(std::uint32_t layer, std::uint32_t rows,
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
  const std::uint32_t* counts = profile_.data() + std::size_t(layer + 1) * L_.n_experts;
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
  if (!opt_.prefetch_backoff) return;
  std::lock_guard<std::mutex> lk(stats_mu_);
  governor_.observe(g);
}

std::vector<std::int32_t> Window::take_routes() {
  std::vector<std::int32_t> out;
  std::lock_guard<std::mutex> lk(stats_mu_);
  out.swap(routes_);
  return out;
}

std::uint32_t Window::wave_capacity() const {
  // Windows sharing the stream share the arena: each gets an equal part, and leaves one top-k
  // of it for the next layer's prefetches. Then the experts every Window keeps for its executing
  // layer add up to at most n_slots - windows * top_k, so Windows all waiting for space always
  // find a victim among the rest (no deadlock) as long as the arena holds 2 * top_k per Window.
  const std::uint32_t windows = std::uint32_t(std::max<std::size_t>(1, stream_.n_clients()));
  const std::uint32_t share = stream_.n_slots() / windows;
  return std::max(L_.top_k, share > L_.top_k ? share - L_.top_k : 0u);
}

PlanRules Window::rules() const {
  PlanRules r;
  r.n_layers = L_.n_layers;
  r.n_experts = L_.n_experts;
  r.top_k = L_.top_k;
  r.lookahead = opt_.lookahead;
  r.two_layer_decode = opt_.two_layer_decode;
  r.two_layer_prompt = opt_.two_layer_prompt;
  r.two_layer_max = opt_.two_layer_max;
  r.decode_rows = opt_.decode_rows;
  r.decode_batch_rows = opt_.decode_batch_rows;
  r.split_turn = opt_.split_turn;
  r.moce = opt_.moce;
  return r;
}

Lookahead Window::wants_predictions(std::uint32_t layer, std::uint32_t rows) const {
  if (layer >= L_.n_layers)
    throw std::out_of_range("layer " + std::to_string(layer) + " out of range [0, " +
                            std::to_string(L_.n_layers) + ")");
  Lookahead l = call_lookahead(rules_, layer, rows, opt_.max_rows, wave_capacity());
  if (l.next && all_resident_for_good(layer + 1)) l.next = false;
  if (l.two_layer && all_resident_for_good(layer + 2)) l.two_layer = false;
  return l;
}

bool Window::all_resident_for_good(std::uint32_t layer) const {
  // Slots are recycled only when no slot is free (take_slot), which an arena of every key's
  // slot never lacks for a key not yet resident: a published key of such an arena stays so.
  if (layer >= L_.n_layers || stream_.n_slots() < L_.n_keys()) return false;
  const std::uint32_t* smap = stream_.smap();
  for (std::uint32_t e = 0; e < L_.n_experts; ++e)
    if (smap_load(smap, layer * L_.n_experts + e) == kAbsent) return false;
  return true;
}

ChunkPlan Window::plan(CallKind kind, std::uint32_t layer, std::uint32_t r0, std::uint32_t rows,
                       const Routed* routed, bool queued_done) {
  ChunkRequest q;
  q.kind = kind;
  q.queued_done = queued_done;
  q.layer = layer;
  q.row0 = r0;
  q.rows = rows;
  if (routed) {
    q.has_pred1 = routed->pred1 != nullptr;
    q.has_pred2 = routed->pred2 != nullptr;
    q.rounding = routed->rounding;
    {  // the union of the rows' experts (ids checked): the decode path's bound, and the waves
      std::vector<char>& seen = buf_.batch_marks;
      const std::int32_t* ids = routed->ids + std::size_t(r0) * L_.top_k;
      for (std::size_t i = 0; i < std::size_t(rows) * L_.top_k; ++i)
        if (!seen[std::size_t(ids[i])]) {
          seen[std::size_t(ids[i])] = 1;
          ++q.distinct_experts;
        }
      for (std::size_t i = 0; i < std::size_t(rows) * L_.top_k; ++i)
        seen[std::size_t(ids[i])] = 0;
    }
  }
  return plan_chunk(rules_, q, wave_capacity(), spec_cap());
}

void Window::moe(std::uint32_t layer, const float* x, std::uint32_t rows, float* out,
                 const InterruptCheck& interrupt) {
  if (!L_.has_routers())
    throw EngineError(ErrorKind::Config,
                      "this pack holds no routers (routing external: the model routes itself); "
                      "call moe_routed with the model's expert ids and weights");
  const std::uint32_t H = L_.hidden;
  run_call(
      layer, rows,
      [&](std::uint32_t r0, std::uint32_t n, std::uint32_t chunk) {
        std::memcpy(x_, x + std::size_t(r0) * H, std::size_t(n) * H * 4);
        run_chunk(plan(CallKind::Engine, layer, r0, n, nullptr), chunk, interrupt);
        std::memcpy(out + std::size_t(r0) * H, out_, std::size_t(n) * H * 4);
      },
      interrupt);
}

namespace {

void load_x(const void* x, Window::XType xt, std::size_t first, std::size_t n, float* dst) {
  switch (xt) {
    case Window::XType::F32:
      std::memcpy(dst, static_cast<const float*>(x) + first, n * 4);
      return;
    case Window::XType::F16:
    case Window::XType::BF16: {
      const auto* src = static_cast<const std::uint16_t*>(x) + first;
      for (std::size_t i = 0; i < n; ++i)
        dst[i] = xt == Window::XType::F16 ? half_to_float(src[i]) : bf16_to_float(src[i]);
      return;
    }
  }
}

}  // namespace

void Window::check_routed(std::uint32_t layer, const Routed& routed, std::uint32_t rows,
                          bool need_weights) const {
  if (opt_.moce.mode != MoceMode::Off)
    throw EngineError(ErrorKind::Config,
                      "moce steers the engine's own router; an externally routed call "
                      "(moe_routed) needs moce off");
  // (A layer out of range is run_call's to refuse, naming the range.)
  const Arithmetic a = routed.rounding.arithmetic;
  if (const std::string& why =
          layer < L_.n_layers ? arithmetic_unsupported(a, layer) : arithmetic_unsupported(a);
      !why.empty())
    throw EngineError(ErrorKind::Config, why);
  if (routed.per_entry && !per_entry_why_.empty())
    throw EngineError(ErrorKind::Config, per_entry_why_);
  if (rows == 0) return;
  if (!routed.ids || (need_weights && !routed.weights))
    throw std::invalid_argument("moe_routed needs ids and weights");
  const std::size_t n = std::size_t(rows) * L_.top_k;
  for (const std::int32_t* ids : {routed.ids, routed.pred1, routed.pred2}) {
    if (!ids) continue;
    for (std::size_t i = 0; i < n; ++i)
      if (ids[i] < 0 || std::uint32_t(ids[i]) >= L_.n_experts)
        throw std::out_of_range("expert id " + std::to_string(ids[i]) + " at entry " +
                                std::to_string(i) + " out of range [0, " +
                                std::to_string(L_.n_experts) + ")");
  }
}

void Window::stage_routed(const Routed& routed, std::uint32_t r0, std::uint32_t n) {
  const std::size_t k = L_.top_k, first = std::size_t(r0) * k, count = std::size_t(n) * k;
  std::copy(routed.ids + first, routed.ids + first + count, ids_);
  if (routed.weights) std::copy(routed.weights + first, routed.weights + first + count, weights_);
  if (routed.pred1) std::copy(routed.pred1 + first, routed.pred1 + first + count, pred1_);
  if (routed.pred2) std::copy(routed.pred2 + first, routed.pred2 + first + count, pred2_);
}

void Window::moe_routed(std::uint32_t layer, const void* x, XType xt, std::uint32_t rows,
                        const Routed& routed, float* out, const InterruptCheck& interrupt) {
  check_routed(layer, routed, rows, true);
  const std::size_t H = L_.hidden, k = L_.top_k;
  run_call(
      layer, rows,
      [&](std::uint32_t r0, std::uint32_t n, std::uint32_t chunk) {
        load_x(x, xt, r0 * H, n * H, x_);
        stage_routed(routed, r0, n);
        run_chunk(plan(CallKind::Routed, layer, r0, n, &routed), chunk, interrupt);
        // The chunk is done: the backend wrote y (every entry) and out (their sums) in the
        // scratch the host reads.
        if (routed.per_entry)
          std::memcpy(out + r0 * k * H, scratch_.buffers().y, n * k * H * 4);
        else
          std::memcpy(out + r0 * H, out_, n * H * 4);
      },
      interrupt);
}

namespace {

// Points the backend at one chunk's device rows for as long as it lives; the scratch again after
// (also when the chunk throws: the next call may be a host one).
class ChunkDeviceIo {
 public:
  // A pointer the backend refuses (not its device's memory) is the caller's mistake.
  ChunkDeviceIo(Backend& b, const DeviceIo& io) : b_(b) {
    try {
      b_.set_device_io(io);
    } catch (const std::invalid_argument& e) {
      throw EngineError(ErrorKind::Config, e.what());
    }
  }
  ~ChunkDeviceIo() {
    try {
      b_.set_device_io({});
    } catch (...) {  // {} names no pointer: nothing to refuse
    }
  }
  ChunkDeviceIo(const ChunkDeviceIo&) = delete;
  ChunkDeviceIo& operator=(const ChunkDeviceIo&) = delete;

 private:
  Backend& b_;
};

}  // namespace

void Window::moe_routed_device(std::uint32_t layer, const float* x, std::uint32_t rows,
                               const Routed& routed, float* out, const InterruptCheck& interrupt,
                               std::optional<std::uintptr_t> stream) {
  if (!device_io_why_.empty())
    throw EngineError(ErrorKind::Config, "backend '" + backend_name_ + "': " + device_io_why_);
  if (routed.rounding.arithmetic != Arithmetic::Float32)
    throw EngineError(ErrorKind::Config,
                      "a call on device memory computes in float32 (arithmetic='float32')");
  check_routed(layer, routed, rows, true);
  if (rows > 0 && (!x || !out)) throw std::invalid_argument("moe_routed_device needs x and out");
  const std::uint32_t H = L_.hidden;
  // With the caller's stream on a backend that completes asynchronously, every chunk returns
  // with its kernels queued (the caller's stream waits for them), so the device runs a long
  // call's chunks back to back; keep_queued_chunk() decides at each host point whether the
  // chunks before may stay queued.
  const bool queued = stream.has_value() && completes_async_;
  run_call(
      layer, rows,
      [&](std::uint32_t r0, std::uint32_t n, std::uint32_t chunk) {
        const std::size_t first = std::size_t(r0) * H;
        // The backend reads x and writes out on the device: the host scratch's x and out are
        // neither filled nor read (the ids and weights are staged as for any routed call).
        ChunkDeviceIo io(*backend_,
                         DeviceIo{x + first, out + first, stream.has_value(), stream.value_or(0)});
        stage_routed(routed, r0, n);
        run_chunk(plan(CallKind::Routed, layer, r0, n, &routed, queued), chunk, interrupt);
      },
      interrupt, queued);
}

void Window::moe_routed_external(std::uint32_t layer, std::uint32_t rows, const Routed& routed,
                                 const WaveCompute& compute, const InterruptCheck& interrupt) {
  check_routed(layer, routed, rows, false);
  if (!compute) throw std::invalid_argument("moe_routed_external needs a compute function");
  run_call(
      layer, rows,
      [&](std::uint32_t r0, std::uint32_t n, std::uint32_t chunk) {
        stage_routed(routed, r0, n);
        run_chunk(plan(CallKind::External, layer, r0, n, &routed), chunk, interrupt, &compute);
      },
      interrupt);
}

void Window::run_call(std::uint32_t layer, std::uint32_t rows, const ChunkFn& run,
                      const InterruptCheck& interrupt, bool queued) {
  if (layer >= L_.n_layers)
    throw std::out_of_range("layer " + std::to_string(layer) + " out of range [0, " +
                            std::to_string(L_.n_layers) + ")");
  Call call(*this);
  bool opens = false;
  {
    std::lock_guard<std::mutex> lk(door_mu_);
    if (turn_ == TurnKind::None) {
      if (layer != 0)
        throw EngineError(ErrorKind::Turn, "layer " + std::to_string(layer) +
                                               " called outside a turn: a turn starts at layer 0");
      if (rows == 0) return;
      turn_ = TurnKind::Implicit;  // ends after layer L-1
      owner_ = std::this_thread::get_id();
      next_layer_ = 0;
      opens = true;
    } else if (layer != next_layer_) {
      throw EngineError(ErrorKind::Turn, "layer " + std::to_string(layer) +
                                             " called out of order: this turn expects layer " +
                                             std::to_string(next_layer_) + " next");
    }
  }
  if (rows == 0) return;
  if (layer == 0) {  // a new pass over the model starts with these tokens
    pass_first_token_ = tokens_seen_;
    tokens_seen_ += rows;
  }
  try {
    // First, before anything may evict or unprotect a slot: the last call's kernels finished
    // (a call that returned with them queued left its layer's protections standing: I4).
    retire_completion();
    if (opens) queue_start_layers();
    std::vector<std::int32_t>& chosen = buf_.call_chosen;
    chosen.clear();
    const std::uint32_t chunk_rows = std::min(rows, opt_.max_rows);
    ensure_scratch(chunk_rows);
    std::uint32_t chunk = 0;
    for (std::uint32_t r0 = 0; r0 < rows; r0 += opt_.max_rows, ++chunk) {
      run(r0, std::min(opt_.max_rows, rows - r0), chunk);
      for (std::int32_t e : buf_.chosen)
        if (!buf_.seen[std::uint32_t(e)]) {
          buf_.seen[std::uint32_t(e)] = 1;
          chosen.push_back(e);
        }
    }
    for (std::int32_t e : chosen) buf_.seen[std::uint32_t(e)] = 0;
    // finish_layer keeps this layer's slots protected (executing) and adds layer l+1's, so it
    // may run while the kernels are queued; the next at_layer ends them, after a retire.
    after(layer, chosen, interrupt);
    if (queued) defer_completion();
    with_stats(layer, [&](LayerStats& st) {
      st.calls += 1;
      st.tokens += rows;
    });
  } catch (...) {
    std::fill(buf_.seen.begin(), buf_.seen.end(), 0);  // a chunk may have failed mid-way
    abandon_call();
    throw;
  }
  bool ends = false;
  {
    std::lock_guard<std::mutex> lk(door_mu_);
    next_layer_ = (layer + 1) % L_.n_layers;
    ends = turn_ == TurnKind::Implicit && layer + 1 == L_.n_layers;
  }
  if (ends) {
    if (queued)
      defer_turn_end();  // the stream's end_turn would drop the queued kernels' protections
    else
      finish_turn();
  }
}

void Window::abandon_call() {
  // The device skips what is queued, the turn ends, the stream stays usable.
  backend_->abort_pending();
  drain();  // a deferred turn end's protections end with the end_turn below
  pending_turn_prompt_ = false;
  // Aborting woke the device by signalling the value it waited for, which can be ahead of the
  // counters (waves encoded but never released). Resume past every value an event holds, so
  // no stale signal can release a later wait.
  for (SharedEvent* ev : {&routed_, &release1_, &release2_, &done_})
    seq_ = std::max(seq_, ev->value());
  for (SharedEvent* ev : {&wave_release_, &wave_done_})
    wave_seq_ = std::max(wave_seq_, ev->value());
  stream_.release_plan(client_);
  stream_.end_turn(client_);
  turn_prompt_ = false;  // the next turn judges its own scratch
  std::lock_guard<std::mutex> lk(door_mu_);
  turn_ = TurnKind::None;
  owner_ = {};
  next_layer_ = 0;
}

void Window::by_popularity(const std::int32_t* ids, std::uint32_t n,
                           std::vector<std::int32_t>& experts) {
  std::vector<std::uint32_t>& count = buf_.votes;  // all zero between calls
  experts.clear();
  for (std::uint32_t i = 0; i < n; ++i)
    if (count[std::uint32_t(ids[i])]++ == 0) experts.push_back(ids[i]);
  std::sort(experts.begin(), experts.end(), [&](std::int32_t a, std::int32_t b) {
    return count[std::uint32_t(a)] > count[std::uint32_t(b)] ||
           (count[std::uint32_t(a)] == count[std::uint32_t(b)] && a < b);
  });
  for (std::int32_t e : experts) count[std::uint32_t(e)] = 0;
}

void Window::add_speculation(const ChunkPlan& p, std::uint32_t chunk, HandshakeRequest& r) {
  const std::uint32_t n = p.rows * L_.top_k;
  buf_.pred1.clear();
  buf_.pred2.clear();
  if (p.predict.next) {
    by_popularity(pred1_, n, buf_.pred1);  // ordered by how many tokens chose each
    // Noted for precision/recall when this chunk reaches layer + 1.
    auto& noted = predicted_[p.layer + 1];
    if (noted.size() <= chunk) noted.resize(chunk + 1);
    noted[chunk].assign(buf_.pred1.begin(), buf_.pred1.end());
  }
  if (p.predict.two_layer) by_popularity(pred2_, n, buf_.pred2);
  profile_candidates(p.layer, p.rows, buf_.profile);
  r.next_layer = buf_.pred1.data();
  r.n_next_layer = buf_.pred1.size();
  r.two_layer = buf_.pred2.data();
  r.n_two_layer = buf_.pred2.size();
  r.profile = buf_.profile.data();
  r.n_profile = buf_.profile.size();
  r.spec_budget = p.spec_budget;
  r.two_layer_max = p.two_layer_max;
}

void Window::record_actual(std::uint32_t layer, std::uint32_t chunk,
                           const std::vector<std::int32_t>& chosen) {
  auto& noted = predicted_[layer];
  if (chunk >= noted.size() || noted[chunk].empty()) return;
  std::vector<char>& actual = buf_.actual;  // all zero between uses
  for (std::int32_t e : chosen) actual[std::uint32_t(e)] = 1;
  std::uint64_t correct = 0;
  for (std::int32_t e : noted[chunk]) correct += actual[std::uint32_t(e)];
  for (std::int32_t e : chosen) actual[std::uint32_t(e)] = 0;
  with_stats(layer, [&](LayerStats& s) {
    s.pred_correct += correct;
    s.pred_predicted += noted[chunk].size();
    s.pred_actual += chosen.size();
  });
  noted[chunk].clear();
}

void Window::wait_device(SharedEvent& ev, std::uint64_t v, const InterruptCheck& interrupt,
                         AdaptiveSpin& spin) {
  const bool answered = spin.wait([&] { return ev.value() >= v; }, [&] {
    return ev.wait_for(v, std::chrono::duration<double>(opt_.device_timeout_s), interrupt);
  });
  if (!answered)
    throw EngineError(ErrorKind::Timeout, "the " + backend_->name() +
                                              " device did not reach the handshake within " +
                                              std::to_string(opt_.device_timeout_s) + " s");
  raise_device_error();
}

void Window::stall_for(std::uint32_t layer, const std::int32_t* experts, std::size_t n,
                       const InterruptCheck& interrupt) {
  auto t0 = Clock::now();
  stream_.wait(client_, layer, experts, n, interrupt);
  const std::uint64_t dt = ns_since(t0);
  with_stats(layer, [&](LayerStats& st) { st.stall_ns += dt; });
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
  const std::uint64_t dt = ns_since(t0);
  with_stats(layer, [&](LayerStats& st) { st.settle_ns += dt; });
}

void Window::note_moce(std::uint32_t layer, std::uint32_t rows) {
  if (opt_.moce.mode == MoceMode::Off) return;
  const DeviceBuffers& b = scratch_.buffers();
  std::lock_guard<std::mutex> lk(stats_mu_);
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
  stream_.finish_layer(client_, layer, chosen.data(), chosen.size());
  add_host_time(layer, timer);
}

// ---- one chunk: the first submission, the host point, then the plan's executor -----------------

void Window::read_routing(const ChunkPlan& p, std::uint32_t chunk) {
  const std::uint32_t k = L_.top_k, n = p.rows * k;
  by_popularity(ids_, n, buf_.chosen);
  {
    std::lock_guard<std::mutex> lk(stats_mu_);
    for (std::uint32_t i = 0; i < n; ++i)  // learn the popularity profile online
      ++profile_[std::size_t(p.layer) * L_.n_experts + std::uint32_t(ids_[i])];
    if (opt_.record_routes)
      for (std::uint32_t i = 0; i < n; ++i)
        routes_.insert(routes_.end(), {std::int32_t(pass_first_token_ + p.row0 + i / k),
                                       std::int32_t(p.layer), ids_[i]});
  }
  record_actual(p.layer, chunk, buf_.chosen);
}

void Window::run_chunk(const ChunkPlan& p, std::uint32_t chunk, const InterruptCheck& interrupt,
                       const WaveCompute* compute) {
  STRATA_ASSERT((compute != nullptr) == (p.kind == CallKind::External),
                "the caller computes exactly the external path's experts");
  if (!p.decode_path) turn_prompt_ = true;
  const Clock::time_point start = Clock::now();  // the governor's trials compare this
  // Before anything of this chunk is submitted: a drain waits for an idle device.
  const bool keep = keep_queued_chunk(p);
  const std::uint64_t v = ++seq_;
  const std::uint64_t first_wave = wave_seq_ + 1;
  if (p.device_before_host) {
    encode_chunk(p, events_, v, first_wave, buf_.commands);
    submit(buf_.commands);
    if (p.routed_signal) {
      wait_device(routed_, v, interrupt, spin_routed_);
      note_moce(p.layer, p.rows);
    }
  }
  settle(p.layer, interrupt);
  if (p.executor == Executor::Decode)
    run_decode(p, chunk, v, keep, start, interrupt);
  else
    run_waves(p, chunk, v, first_wave, keep, start, interrupt, compute);
  if (p.queued_done) defer_chunk();  // its kernels may still be queued: protections stand
}

void Window::run_decode(const ChunkPlan& p, std::uint32_t chunk, std::uint64_t v, bool keep,
                        Clock::time_point start, const InterruptCheck& interrupt) {
  HostTimer at_layer;
  read_routing(p, chunk);
  const std::vector<std::int32_t>& chosen = buf_.chosen;
  HandshakeRequest q;
  q.layer = p.layer;
  q.urgent = chosen.data();
  q.n_urgent = chosen.size();
  add_speculation(p, chunk, q);
  q.keep_executing = keep;
  const SpecWatch watch = watch_spec();
  // at_layer ends the previous protections: none of their kernels may still be queued, unless
  // it keeps them.
  STRATA_ASSERT(completion_ == Completion::Done || q.keep_executing,
                "the last call's kernels finished (I4)");
  const AtLayerResult r = stream_.at_layer(client_, q, interrupt);
  count_urgent(p.layer, r.urgent);
  add_host_time(p.layer, at_layer);
  if (p.split) {
    encode_step(p, Step::ResidentPass, events_, v, buf_.commands);
    submit(buf_.commands);
  } else {
    release1_.signal(v);
  }
  stall_for(p.layer, chosen.data(), chosen.size(), interrupt);  // the resident pass runs meanwhile
  const bool missed = r.urgent.misses > 0;
  const bool contended = missed && spec_overlapped(watch);
  if (p.split) {
    encode_step(p, Step::MissingPass, events_, v, buf_.commands);
    submit(buf_.commands);
  } else {
    release2_.signal(v);
  }
  wait_device(done_, v, interrupt, spin_done_);
  observe_handshake(true, missed, contended, ns_since(start));
}

void Window::run_waves(const ChunkPlan& p, std::uint32_t chunk, std::uint64_t v,
                       std::uint64_t first_wave, bool keep, Clock::time_point start,
                       const InterruptCheck& interrupt, const WaveCompute* compute) {
  HostTimer at_layer;
  read_routing(p, chunk);
  const std::vector<std::int32_t>& chosen = buf_.chosen;
  const std::uint32_t n_waves = p.waves(chosen.size());
  STRATA_ASSERT(compute || n_waves <= p.max_waves, "waves fit the encoded submission");
  const bool multi = n_waves > 1;
  STRATA_ASSERT(!keep || n_waves == 1, "a chunk that keeps the queued ones runs in one wave");
  add_host_time(p.layer, at_layer);
  // Every expert of a wave is resident before the wave may start.
  bool missed = false, contended = false;
  for (std::uint32_t w = 0; w < n_waves; ++w) {
    const std::size_t begin = std::size_t(w) * p.wave_capacity;
    const std::size_t end = std::min<std::size_t>(begin + p.wave_capacity, chosen.size());
    const std::int32_t* wave = chosen.data() + begin;
    const std::size_t n = end - begin;
    HostTimer wave_timer;
    HandshakeRequest q;  // finished waves make room: only this wave's experts are protected
    q.layer = p.layer;
    q.urgent = wave;
    q.n_urgent = n;
    q.publish = w == 0;
    q.keep_executing = keep;
    if (w + 1 == n_waves) add_speculation(p, chunk, q);  // behind the last wave's reads
    const SpecWatch watch = watch_spec();
    STRATA_ASSERT(completion_ == Completion::Done || keep, "the last call's kernels finished (I4)");
    const AtLayerResult r = stream_.at_layer(client_, q, interrupt);
    count_urgent(p.layer, r.urgent);
    add_host_time(p.layer, wave_timer);
    stall_for(p.layer, wave, n, interrupt);
    if (r.urgent.misses > 0) {
      missed = true;
      contended = contended || spec_overlapped(watch);
    }
    if (compute) {
      // The caller's expert pass over this wave: each entry's slot from one locked snapshot
      // (at_layer protects them; with several waves the snapshot pins them too: I4, I8).
      buf_.wave_slots.resize(n);
      stream_.plan_slots(client_, p.layer, wave, n, buf_.wave_slots.data(), multi);
      for (std::size_t i = 0; i < n; ++i) {
        STRATA_ASSERT(buf_.wave_slots[i] != kAbsent, "a waited-for expert is published");
        buf_.slot_of[std::uint32_t(wave[i])] = buf_.wave_slots[i];
      }
      buf_.entry_slots.resize(std::size_t(p.rows) * L_.top_k);
      for (std::size_t i = 0; i < buf_.entry_slots.size(); ++i)
        buf_.entry_slots[i] = buf_.slot_of[std::uint32_t(ids_[i])];
      for (std::size_t i = 0; i < n; ++i) buf_.slot_of[std::uint32_t(wave[i])] = kAbsent;
      (*compute)(p.row0, p.rows, buf_.entry_slots.data());
      if (multi) stream_.release_plan(client_);
      continue;
    }
    if (multi) {  // I8 by pins
      buf_.wave_slots.resize(n);
      stream_.plan_slots(client_, p.layer, wave, n, buf_.wave_slots.data(), true);
    }
    std::copy(wave, wave + n, wave_);
    wave_n_[0] = std::uint32_t(n);
    const std::uint64_t wv = ++wave_seq_;
    if (p.split) {
      encode_step(p, Step::Wave, events_, wv, buf_.commands);
      submit(buf_.commands);
    } else {
      wave_release_.signal(wv);
    }
    wait_device(wave_done_, wv, interrupt, spin_wave_);
    if (multi) stream_.release_plan(client_);
  }
  with_stats(p.layer, [&](LayerStats& st) { st.waves += n_waves; });
  if (!compute) {
    if (p.split) {
      encode_step(p, Step::Finish, events_, v, buf_.commands);
      submit(buf_.commands);
    } else {
      for (std::uint64_t wv = first_wave + n_waves; wv < first_wave + p.max_waves; ++wv) {
        wave_n_[0] = 0;  // encoded waves this chunk needs not
        wave_seq_ = wv;
        wave_release_.signal(wv);
        wait_device(wave_done_, wv, interrupt, spin_wave_);
      }
    }
    wait_device(done_, v, interrupt, spin_done_);
  }
  observe_handshake(false, missed, contended, ns_since(start));
}

}  // namespace strata
