// The Window as one layer call reads it: admission and the turn (TurnGate), the plan of each
// chunk (plan_chunk), the handshake at each host point (ExpertStream::at_layer, with the
// Speculator's reads ahead), and the executors that release the device around it. What a
// call leaves queued is the Completion's; what it counts is the Recorder's.
#include "exec/window.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <utility>

#include "common/check.h"
#include "common/errors.h"
#include "common/timing.h"
#include "residency/slot.h"

namespace strata {

namespace {

Backend& required(const std::unique_ptr<Backend>& backend) {
  if (!backend) throw EngineError(ErrorKind::Config, "Window needs a backend");
  return *backend;
}

}  // namespace

// ---- construction and close -------------------------------------------------------------------

Window::Window(ExpertStream& stream, std::unique_ptr<Backend> backend,
               const WindowOptions& options)
    : stream_(stream),
      backend_(std::move(backend)),
      backend_name_(backend_ ? backend_->name() : ""),
      backend_tuning_(backend_ ? backend_->tuning() : ""),
      host_spin_(backend_ ? backend_->host_spin() : std::chrono::microseconds(0)),
      spin_routed_(host_spin_),
      spin_wave_(host_spin_),
      spin_done_(host_spin_),
      L_(stream.layout()),
      support_(required(backend_), L_, options.moce),
      opt_(options.validated(L_)),
      routers_(stream.file().read_routers()),
      rules_(opt_.plan_rules(L_)),
      scratch_(stream, routers_.data()),
      popularity_(L_.n_experts),
      recorder_(L_, options.record_routes),
      speculator_(stream, recorder_, opt_.speculation()) {
  buf_.seen.assign(L_.n_experts, 0);
  buf_.marks.assign(L_.n_experts, 0);
  buf_.slot_of.assign(L_.n_experts, kAbsent);
  scratch_.bind(1, *backend_);
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

void Window::close() {
  if (!gate_.begin_close()) return;
  teardown();
  gate_.finish_close();
}

void Window::teardown() {
  // First, so that no new IO completion calls into the backend; returns once no IO thread is
  // inside its observer (a device copy in progress finishes), so the backend may then go.
  if (observer_) stream_.remove_observer(*observer_);
  observer_.reset();
  backend_->abort_pending();
  drain();  // no device work in flight from here; a pending one's protections end just below
  completion_.take_turn_prompt();
  stream_.release_client(client_);  // the turn's protections and pins end with it
  backend_.reset();  // joins the device thread and its worker pool
  scratch_.release();
  std::vector<float>().swap(routers_);
}

// ---- the pending completion: a call that returned with its kernels queued (I4) ---------------

Completion::State Window::drain() {
  backend_->synchronize();  // every kernel submitted has finished
  return completion_.drained();
}

void Window::retire_completion() {
  if (!completion_.pending()) return;
  // The provable point: every kernel of the last call has finished.
  if (drain() == Completion::State::TurnEndPending)
    end_turn_in_stream(completion_.take_turn_prompt());
  // A fault the drained kernels met (an asynchronous one shows only at the drain) fails the
  // call that retires them: their output was already the caller's, so it must not go unsaid.
  raise_device_error();
}

void Window::raise_device_error() {
  std::string err = backend_->take_device_error();
  if (!err.empty()) throw EngineError(ErrorKind::Device, err);
}

// Before anything of the call's next chunk `p` (its ids staged) is submitted: whether the
// earlier chunks still queued (ChunkPending) keep their experts protected beside this one's
// (at_layer's keep_executing). Only a one-wave chunk whose experts and the call's so far fit a
// wave keeps them; otherwise the backend drains here (Done), so the waves find the room they
// would find after any drained chunk.
bool Window::keep_queued_chunk(const ChunkPlan& p) {
  if (completion_.state() != Completion::State::ChunkPending) return false;
  STRATA_ASSERT(p.kind == CallKind::Routed, "only a routed call's chunks return queued");
  // Routed: the waves encoded are the waves the chunk runs (plan_chunk counts its experts).
  if (p.executor == Executor::Decode || p.max_waves == 1) {
    // buf_.seen marks the call's experts so far (the earlier chunks', all still protected);
    // buf_.marks, kept zero, this chunk's.
    const std::int32_t* ids = scratch_.buffers().ids;
    std::size_t together = buf_.call_chosen.size();
    const std::size_t n = std::size_t(p.rows) * L_.top_k;
    for (std::size_t i = 0; i < n; ++i) {
      const std::uint32_t e = std::uint32_t(ids[i]);
      if (!buf_.seen[e] && !buf_.marks[e]) {
        buf_.marks[e] = 1;
        ++together;
      }
    }
    for (std::size_t i = 0; i < n; ++i) buf_.marks[std::uint32_t(ids[i])] = 0;
    if (together <= p.wave_capacity) return true;
  }
  drain();  // the earlier chunks' kernels finished: their protections may go
  raise_device_error();
  return false;
}

// ---- turns ------------------------------------------------------------------------------------

void Window::begin_turn() {
  TurnGate::Call call(gate_);
  if (gate_.implicit_open()) finish_turn();
  retire_completion();  // a turn that ended with its kernels queued ends in the stream first
  gate_.open_explicit();
  STRATA_ASSERT(!completion_.pending(), "no queued kernel may lose its protections");
  speculator_.start_turn(client_);
}

void Window::end_turn() {
  // Nothing to end: closed, or no turn and none whose end the stream still waits for.
  if (gate_.closed() || (!gate_.in_turn() && !completion_.pending())) return;
  TurnGate::Call call(gate_, /*closed_ok=*/true);  // Turn error from another thread's turn
  if (!call.admitted()) return;                    // closed meanwhile: close() ended the turn
  if (gate_.in_turn())
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
  [[maybe_unused]] const Completion::State was = drain();
  STRATA_ASSERT(was == Completion::State::Done, "an open turn owes the stream no turn end");
  gate_.close_turn();
  end_turn_in_stream(std::exchange(turn_prompt_, false));
  if (fault) std::rethrow_exception(fault);
}

void Window::end_turn_in_stream(bool prompt) {
  STRATA_ASSERT(!completion_.pending(), "no kernel of this Window is in flight");
  stream_.end_turn(client_);  // no device work in flight: protections end with the turn
  // Without BUF_REUSE a prompt's scratch goes back to the system between turns; a decode-path
  // one (a few rows, or a decode batch's at most decode_batch_rows) is not worth the churn.
  if (!opt_.prompt_buf_reuse && prompt && scratch_.rows() > opt_.decode_rows)
    scratch_.release(*backend_);
}

void Window::abandon_call() {
  // The device skips what is queued, the turn ends, the stream stays usable.
  backend_->abort_pending();
  drain();  // a deferred turn end's protections end with the end_turn below
  completion_.take_turn_prompt();
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
  gate_.close_turn();
}

void Window::set_profile(const std::vector<std::uint32_t>& counts) {
  recorder_.check_profile(counts);  // its size first: a Config error from any thread
  TurnGate::Call call(gate_);       // the driving call reads the profile without a lock
  recorder_.set_profile(counts);
}

// ---- the plan ---------------------------------------------------------------------------------

std::uint32_t Window::wave_capacity() const {
  // Windows sharing the stream share the arena: each gets an equal part, and leaves one top-k
  // of it for the next layer's prefetches. Then the experts every Window keeps for its executing
  // layer add up to at most n_slots - windows * top_k, so Windows all waiting for space always
  // find a victim among the rest (no deadlock) as long as the arena holds 2 * top_k per Window.
  const std::uint32_t windows = std::uint32_t(std::max<std::size_t>(1, stream_.n_clients()));
  const std::uint32_t share = stream_.n_slots() / windows;
  return std::max(L_.top_k, share > L_.top_k ? share - L_.top_k : 0u);
}

Lookahead Window::wants_predictions(std::uint32_t layer, std::uint32_t rows) const {
  if (layer >= L_.n_layers)
    throw std::out_of_range("layer " + std::to_string(layer) + " out of range [0, " +
                            std::to_string(L_.n_layers) + ")");
  return speculator_.useful(
      layer, call_lookahead(rules_, layer, rows, opt_.max_rows, wave_capacity()));
}

// plan_chunk with this Window's rules, its wave capacity now and the governor's cap now; for a
// routed chunk, `distinct` is the union of its rows' experts (stage_routed counted it).
ChunkPlan Window::plan(CallKind kind, std::uint32_t layer, std::uint32_t r0, std::uint32_t rows,
                       std::uint32_t distinct, const Routed* routed, bool queued_done) const {
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
    q.distinct_experts = distinct;
  }
  return plan_chunk(rules_, q, wave_capacity(), speculator_.cap(q.layer));
}

// ---- the calls --------------------------------------------------------------------------------

void Window::moe(std::uint32_t layer, const float* x, std::uint32_t rows, float* out,
                 const InterruptCheck& interrupt) {
  if (!L_.has_routers())
    throw EngineError(ErrorKind::Config,
                      "this pack holds no routers (routing external: the model routes itself); "
                      "call moe_routed with the model's expert ids and weights");
  const std::size_t H = L_.hidden;
  const DeviceBuffers& b = scratch_.buffers();
  run_call(
      layer, rows,
      [&](std::uint32_t r0, std::uint32_t n, std::uint32_t chunk) {
        std::memcpy(b.x, x + r0 * H, n * H * 4);
        run_chunk(plan(CallKind::Engine, layer, r0, n), chunk, interrupt);
        std::memcpy(out + r0 * H, b.out, n * H * 4);
      },
      interrupt);
}

void Window::moe_routed(std::uint32_t layer, const void* x, XType xt, std::uint32_t rows,
                        const Routed& routed, float* out, const InterruptCheck& interrupt) {
  check_routed(routed, layer, rows, true, L_, support_, opt_.moce.mode);
  const std::size_t H = L_.hidden, k = L_.top_k;
  const DeviceBuffers& b = scratch_.buffers();
  run_call(
      layer, rows,
      [&](std::uint32_t r0, std::uint32_t n, std::uint32_t chunk) {
        load_x(x, xt, r0 * H, n * H, b.x);
        const std::uint32_t d = stage_routed(routed, L_.top_k, r0, n, b, buf_.marks);
        run_chunk(plan(CallKind::Routed, layer, r0, n, d, &routed), chunk, interrupt);
        // The chunk is done: the backend wrote y (every entry) and out (their sums) in the
        // scratch the host reads.
        if (routed.per_entry)
          std::memcpy(out + r0 * k * H, b.y, n * k * H * 4);
        else
          std::memcpy(out + r0 * H, b.out, n * H * 4);
      },
      interrupt);
}

void Window::moe_routed_device(std::uint32_t layer, const float* x, std::uint32_t rows,
                               const Routed& routed, float* out, const InterruptCheck& interrupt,
                               std::optional<std::uintptr_t> stream) {
  if (!support_.device_io.empty())
    throw EngineError(ErrorKind::Config, "backend '" + backend_name_ + "': " + support_.device_io);
  if (routed.rounding.arithmetic != Arithmetic::Float32)
    throw EngineError(ErrorKind::Config,
                      "a call on device memory computes in float32 (arithmetic='float32')");
  check_routed(routed, layer, rows, true, L_, support_, opt_.moce.mode);
  if (rows > 0 && (!x || !out)) throw std::invalid_argument("moe_routed_device needs x and out");
  const std::uint32_t H = L_.hidden;
  // With the caller's stream on a backend that completes asynchronously, every chunk returns
  // with its kernels queued (the caller's stream waits for them), so the device runs a long
  // call's chunks back to back; keep_queued_chunk() decides at each host point whether the
  // chunks before may stay queued.
  const bool queued = stream.has_value() && support_.completes_async;
  const DeviceBuffers& b = scratch_.buffers();
  run_call(
      layer, rows,
      [&](std::uint32_t r0, std::uint32_t n, std::uint32_t chunk) {
        const std::size_t first = std::size_t(r0) * H;
        // The backend reads x and writes out on the device: the host scratch's x and out are
        // neither filled nor read (the ids and weights are staged as for any routed call).
        ChunkDeviceIo io(*backend_,
                         DeviceIo{x + first, out + first, stream.has_value(), stream.value_or(0)});
        const std::uint32_t d = stage_routed(routed, L_.top_k, r0, n, b, buf_.marks);
        run_chunk(plan(CallKind::Routed, layer, r0, n, d, &routed, queued), chunk, interrupt);
      },
      interrupt, queued);
}

void Window::moe_routed_external(std::uint32_t layer, std::uint32_t rows, const Routed& routed,
                                 const WaveCompute& compute, const InterruptCheck& interrupt) {
  check_routed(routed, layer, rows, false, L_, support_, opt_.moce.mode);
  if (!compute) throw std::invalid_argument("moe_routed_external needs a compute function");
  const DeviceBuffers& b = scratch_.buffers();
  run_call(
      layer, rows,
      [&](std::uint32_t r0, std::uint32_t n, std::uint32_t chunk) {
        const std::uint32_t d = stage_routed(routed, L_.top_k, r0, n, b, buf_.marks);
        run_chunk(plan(CallKind::External, layer, r0, n, d, &routed), chunk, interrupt,
                  &compute);
      },
      interrupt);
}

void Window::pass_layer(std::uint32_t layer, const InterruptCheck& interrupt) {
  run_call(layer, 0, [](std::uint32_t, std::uint32_t, std::uint32_t) {}, interrupt, false, true);
}

void Window::run_call(std::uint32_t layer, std::uint32_t rows, const ChunkFn& run,
                      const InterruptCheck& interrupt, bool queued, bool pass) {
  if (layer >= L_.n_layers)
    throw std::out_of_range("layer " + std::to_string(layer) + " out of range [0, " +
                            std::to_string(L_.n_layers) + ")");
  TurnGate::Call call(gate_);
  const TurnGate::Entry entry = gate_.enter(layer, rows, pass);
  if (entry == TurnGate::Entry::Skip) return;
  if (layer == 0) pass_begun_ = false;  // a new pass over the model starts
  if (!pass_begun_ && rows > 0) {
    recorder_.begin_pass(rows);  // its tokens: the rows of its first call that runs any
    pass_begun_ = true;
  }
  try {
    // First, before anything may evict or unprotect a slot: the last call's kernels finished
    // (a call that returned with them queued left its layer's protections standing: I4).
    retire_completion();
    if (entry == TurnGate::Entry::Opens) speculator_.start_turn(client_);
    std::vector<std::int32_t>& chosen = buf_.call_chosen;
    chosen.clear();
    if (rows > 0) scratch_.bind(std::min(rows, opt_.max_rows), *backend_);
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
    after(layer, rows, chosen, interrupt);
    if (queued) completion_.defer_layer();
  } catch (...) {
    std::fill(buf_.seen.begin(), buf_.seen.end(), 0);  // a chunk may have failed mid-way
    abandon_call();
    throw;
  }
  if (!gate_.advance(layer, L_.n_layers)) return;
  if (!queued) {
    finish_turn();
    return;
  }
  // The stream's end_turn would drop the queued kernels' protections: the Window's turn is
  // over, the stream's ends at the retire.
  completion_.defer_turn_end(std::exchange(turn_prompt_, false));
  gate_.close_turn();
}

// ---- one chunk: the first submission, the host point, then the plan's executor ----------------

void Window::read_routing(const ChunkPlan& p, std::uint32_t chunk, LayerStats& d) {
  const std::int32_t* ids = scratch_.buffers().ids;
  popularity_.rank(ids, p.rows * L_.top_k, buf_.chosen);
  recorder_.learn(p.layer, p.row0, ids, p.rows);
  recorder_.score_predicted(p.layer, chunk, buf_.chosen, d);
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
  recorder_.add(layer, [&](LayerStats& st) { st.stall_ns += dt; });
}

void Window::after(std::uint32_t layer, std::uint32_t rows,
                   const std::vector<std::int32_t>& chosen, const InterruptCheck& interrupt) {
  speculator_.settle(layer, interrupt);
  HostTimer timer;
  // I4: layer+1's router may already run; I7: unchosen predictions of this layer to limbo.
  stream_.finish_layer(client_, layer, chosen.data(), chosen.size());
  LayerStats call;
  call.calls = rows > 0 ? 1 : 0;  // a passed layer (pass_layer) ran no call
  call.tokens = rows;
  recorder_.add_host_time(layer, timer, call);
}

void Window::count_urgent(const RequestResult& r, LayerStats& d) const {
  d.hits += r.hits;
  d.misses += r.misses;
  d.bytes_read += std::uint64_t(r.misses) * L_.record_bytes;
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
    backend_->submit(buf_.commands);
    if (p.routed_signal) {
      wait_device(routed_, v, interrupt, spin_routed_);
      if (opt_.moce.mode != MoceMode::Off)
        recorder_.note_moce(p.layer, p.rows, scratch_.buffers());
    }
  }
  speculator_.settle(p.layer, interrupt);
  if (p.executor == Executor::Decode)
    run_decode(p, chunk, v, keep, start, interrupt);
  else
    run_waves(p, chunk, v, first_wave, keep, start, interrupt, compute);
  if (p.queued_done) completion_.defer_chunk();  // its kernels may still be queued
}

void Window::run_decode(const ChunkPlan& p, std::uint32_t chunk, std::uint64_t v, bool keep,
                        Clock::time_point start, const InterruptCheck& interrupt) {
  HostTimer at_layer;
  LayerStats d;
  read_routing(p, chunk, d);
  const std::vector<std::int32_t>& chosen = buf_.chosen;
  const DeviceBuffers& b = scratch_.buffers();
  HandshakeRequest q;
  q.layer = p.layer;
  q.urgent = chosen.data();
  q.n_urgent = chosen.size();
  q.keep_executing = keep;
  speculator_.fill(p, chunk, b.pred_ids[0], b.pred_ids[1], true, true, q);
  const Speculator::Watch watch = speculator_.watch();
  // at_layer ends the previous protections: none of their kernels may still be queued, unless
  // it keeps them.
  STRATA_ASSERT(!completion_.pending() || keep, "the last call's kernels finished (I4)");
  const AtLayerResult r = stream_.at_layer(client_, q, interrupt);
  count_urgent(r.urgent, d);
  recorder_.add_host_time(p.layer, at_layer, d);
  if (p.split) {
    encode_step(p, Step::ResidentPass, events_, v, buf_.commands);
    backend_->submit(buf_.commands);
  } else {
    release1_.signal(v);
  }
  stall_for(p.layer, chosen.data(), chosen.size(), interrupt);  // the resident pass runs meanwhile
  const bool missed = r.urgent.misses > 0;
  const bool contended = missed && speculator_.overlapped(watch);
  if (p.split) {
    encode_step(p, Step::MissingPass, events_, v, buf_.commands);
    backend_->submit(buf_.commands);
  } else {
    release2_.signal(v);
  }
  wait_device(done_, v, interrupt, spin_done_);
  speculator_.observe(true, missed, contended, ns_since(start), p.layer);
}

void Window::run_waves(const ChunkPlan& p, std::uint32_t chunk, std::uint64_t v,
                       std::uint64_t first_wave, bool keep, Clock::time_point start,
                       const InterruptCheck& interrupt, const WaveCompute* compute) {
  HostTimer at_layer;
  LayerStats d;
  read_routing(p, chunk, d);
  const std::uint32_t n_waves = p.waves(buf_.chosen.size());
  STRATA_ASSERT(compute || n_waves <= p.max_waves, "waves fit the encoded submission");
  STRATA_ASSERT(!keep || n_waves == 1, "a chunk that keeps the queued ones runs in one wave");
  recorder_.add_host_time(p.layer, at_layer, d);
  // Every expert of a wave is resident before the wave may start.
  bool missed = false, contended = false;
  for (std::uint32_t w = 0; w < n_waves; ++w)
    missed = run_wave(p, chunk, w, n_waves, keep, interrupt, compute, contended) || missed;
  recorder_.add(p.layer, [&](LayerStats& st) { st.waves += n_waves; });
  if (!compute) {
    if (p.split) {
      encode_step(p, Step::Finish, events_, v, buf_.commands);
      backend_->submit(buf_.commands);
    } else {
      std::uint32_t* wave_n = scratch_.buffers().wave_n;
      for (std::uint64_t wv = first_wave + n_waves; wv < first_wave + p.max_waves; ++wv) {
        wave_n[0] = 0;  // encoded waves this chunk needs not
        wave_seq_ = wv;
        wave_release_.signal(wv);
        wait_device(wave_done_, wv, interrupt, spin_wave_);
      }
    }
    wait_device(done_, v, interrupt, spin_done_);
  }
  speculator_.observe(false, missed, contended, ns_since(start), p.layer);
}

bool Window::run_wave(const ChunkPlan& p, std::uint32_t chunk, std::uint32_t w,
                      std::uint32_t n_waves, bool keep, const InterruptCheck& interrupt,
                      const WaveCompute* compute, bool& contended) {
  const std::vector<std::int32_t>& chosen = buf_.chosen;
  const std::size_t begin = std::size_t(w) * p.wave_capacity;
  const std::size_t end = std::min<std::size_t>(begin + p.wave_capacity, chosen.size());
  const std::int32_t* wave = chosen.data() + begin;
  const std::size_t n = end - begin;
  const bool multi = n_waves > 1;
  const DeviceBuffers& b = scratch_.buffers();
  HostTimer wave_timer;
  HandshakeRequest q;  // finished waves make room: only this wave's experts are protected
  q.layer = p.layer;
  q.urgent = wave;
  q.n_urgent = n;
  q.keep_executing = keep;
  speculator_.fill(p, chunk, b.pred_ids[0], b.pred_ids[1], w == 0, w + 1 == n_waves, q);
  const Speculator::Watch watch = speculator_.watch();
  STRATA_ASSERT(!completion_.pending() || keep, "the last call's kernels finished (I4)");
  const AtLayerResult r = stream_.at_layer(client_, q, interrupt);
  LayerStats d;
  count_urgent(r.urgent, d);
  recorder_.add_host_time(p.layer, wave_timer, d);
  stall_for(p.layer, wave, n, interrupt);
  const bool missed = r.urgent.misses > 0;
  if (missed) contended = contended || speculator_.overlapped(watch);
  if (compute) {
    compute_wave(p, wave, n, multi, *compute);
    return missed;
  }
  if (multi) {  // I8 by pins
    buf_.wave_slots.resize(n);
    stream_.plan_slots(client_, p.layer, wave, n, buf_.wave_slots.data(), true);
  }
  std::copy(wave, wave + n, b.wave);
  b.wave_n[0] = std::uint32_t(n);
  const std::uint64_t wv = ++wave_seq_;
  if (p.split) {
    encode_step(p, Step::Wave, events_, wv, buf_.commands);
    backend_->submit(buf_.commands);
  } else {
    wave_release_.signal(wv);
  }
  wait_device(wave_done_, wv, interrupt, spin_wave_);
  if (multi) stream_.release_plan(client_);
  return missed;
}

// The caller's expert pass over one wave: each entry's slot from one locked snapshot (at_layer
// protects them; with several waves the snapshot pins them too: I4, I8).
void Window::compute_wave(const ChunkPlan& p, const std::int32_t* wave, std::size_t n, bool multi,
                          const WaveCompute& compute) {
  const std::int32_t* ids = scratch_.buffers().ids;
  buf_.wave_slots.resize(n);
  stream_.plan_slots(client_, p.layer, wave, n, buf_.wave_slots.data(), multi);
  for (std::size_t i = 0; i < n; ++i) {
    STRATA_ASSERT(buf_.wave_slots[i] != kAbsent, "a waited-for expert is published");
    buf_.slot_of[std::uint32_t(wave[i])] = buf_.wave_slots[i];
  }
  buf_.entry_slots.resize(std::size_t(p.rows) * L_.top_k);
  for (std::size_t i = 0; i < buf_.entry_slots.size(); ++i)
    buf_.entry_slots[i] = buf_.slot_of[std::uint32_t(ids[i])];
  for (std::size_t i = 0; i < n; ++i) buf_.slot_of[std::uint32_t(wave[i])] = kAbsent;
  compute(p.row0, p.rows, buf_.entry_slots.data());
  if (multi) stream_.release_plan(client_);
}

}  // namespace strata
