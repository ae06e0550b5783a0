#include "exec/chunk_plan.h"

#include <algorithm>

namespace strata {
namespace {

Command cmd(Op op, std::uint32_t layer = 0, std::uint32_t rows = 0) {
  Command c{};
  c.op = op;
  c.layer = layer;
  c.rows = rows;
  return c;
}

Command event_cmd(Op op, SharedEvent* ev, std::uint64_t v) {
  Command c{};
  c.op = op;
  c.event = ev;
  c.value = v;
  return c;
}

// The chunk's done Signal: queued (raised once the kernels before it are queued) when planned so.
Command done_cmd(const ChunkPlan& p, const HandshakeEvents& ev, std::uint64_t v) {
  Command c = event_cmd(Op::Signal, ev.done, v);
  c.queued = p.queued_done;
  return c;
}

// A wave's wave_done Signal. Queued along with the chunk's done when the chunk runs in one
// wave: after its only wave the host unpins nothing and releases no further wave, so nothing it
// does next needs the wave's kernels finished (the chunk's protections stand until the retire).
Command wave_done_cmd(const ChunkPlan& p, const HandshakeEvents& ev, std::uint64_t v) {
  Command c = event_cmd(Op::Signal, ev.wave_done, v);
  c.queued = p.queued_done && p.max_waves == 1;
  return c;
}

// An expert pass, stamped with the chunk's rounding.
Command pass_cmd(const ChunkPlan& p, Op op, Pass pass = Pass::Resident) {
  Command c = cmd(op, p.layer, p.rows);
  c.pass = pass;
  c.rounding = p.rounding;
  return c;
}

bool decode_sized(const PlanRules& r, std::uint32_t rows, std::uint32_t wave_capacity) {
  return rows <= r.decode_rows && rows * r.top_k <= wave_capacity;
}

Lookahead lookahead(const PlanRules& r, std::uint32_t layer, bool decode_sized, bool has_pred1,
                    bool has_pred2) {
  Lookahead l;
  l.next = r.lookahead && has_pred1 && layer + 1 < r.n_layers;  // I10
  l.two_layer = r.lookahead && has_pred2 && layer + 2 < r.n_layers &&  // I10
                (decode_sized ? r.two_layer_decode : r.two_layer_prompt);
  return l;
}

}  // namespace

ChunkPlan plan_chunk(const PlanRules& rules, const ChunkRequest& q, std::uint32_t wave_capacity,
                     std::uint32_t spec_budget) {
  ChunkPlan p;
  p.kind = q.kind;
  p.layer = q.layer;
  p.row0 = q.row0;
  p.rows = q.rows;
  p.wave_capacity = std::max(1u, wave_capacity);
  p.decode_sized = decode_sized(rules, q.rows, p.wave_capacity);
  p.decode_path = p.decode_sized || (q.distinct_experts > 0 && q.rows <= rules.decode_batch_rows &&
                                     q.distinct_experts <= p.wave_capacity);
  // The host computes in waves whatever the size: there is no device pass to overlap.
  p.executor = p.decode_path && q.kind != CallKind::External ? Executor::Decode : Executor::Waves;
  const bool device_experts = q.kind != CallKind::External;
  // The waves encoded up front: as many as the chunk's distinct experts need where the caller
  // routed (known exactly), else as many as the most it could choose.
  const std::uint32_t most_experts = q.distinct_experts > 0
                                         ? q.distinct_experts
                                         : std::min(rules.n_experts, q.rows * rules.top_k);
  p.max_waves = p.executor == Executor::Waves && device_experts
                    ? (most_experts + p.wave_capacity - 1) / p.wave_capacity
                    : 0;
  const bool routed = q.kind != CallKind::Engine;
  p.predict = lookahead(rules, q.layer, p.decode_sized, !routed || q.has_pred1,
                        !routed || q.has_pred2);
  p.spec_budget = spec_budget;
  p.two_layer_max = rules.two_layer_max;
  p.split = rules.split_turn;
  p.device_before_host = !routed || (!p.split && device_experts);
  p.queued_done = q.kind == CallKind::Routed && q.queued_done;
  p.routed_signal = p.device_before_host && !p.queued_done;
  p.rounding = q.kind == CallKind::Routed ? q.rounding : Rounding{};
  if (!routed) p.moce = rules.moce;
  return p;
}

Lookahead call_lookahead(const PlanRules& rules, std::uint32_t layer, std::uint32_t rows,
                         std::uint32_t max_rows, std::uint32_t wave_capacity) {
  Lookahead any;
  if (rows == 0 || max_rows == 0) return any;
  // Chunks are max_rows rows each but the last: at most two distinct chunk sizes.
  for (std::uint32_t n : {std::min(rows, max_rows), rows % max_rows}) {
    if (n == 0) continue;
    const Lookahead l = lookahead(rules, layer, decode_sized(rules, n, std::max(1u, wave_capacity)),
                                  true, true);
    any.next = any.next || l.next;
    any.two_layer = any.two_layer || l.two_layer;
  }
  return any;
}

void encode_chunk(const ChunkPlan& p, const HandshakeEvents& ev, std::uint64_t v,
                  std::uint64_t first_wave, std::vector<Command>& out) {
  out.clear();
  if (!p.device_before_host) return;
  if (p.kind == CallKind::Engine) {
    Command route = cmd(Op::Route, p.layer, p.rows);
    route.moce = p.moce;
    out.push_back(route);
    for (std::uint32_t d : {1u, 2u}) {  // the router scratch is reused; each id buffer is its own
      if (!(d == 1 ? p.predict.next : p.predict.two_layer)) continue;
      Command c = cmd(Op::RoutePredict, p.layer + d, p.rows);
      c.distance = d;
      out.push_back(c);
    }
  }
  if (p.routed_signal) out.push_back(event_cmd(Op::Signal, ev.routed, v));
  if (p.split || p.kind == CallKind::External) return;
  if (p.executor == Executor::Decode) {
    out.push_back(event_cmd(Op::Wait, ev.release_resident, v));
    out.push_back(cmd(Op::Plan, p.layer, p.rows));
    out.push_back(pass_cmd(p, Op::GateUp, Pass::Resident));
    out.push_back(pass_cmd(p, Op::Down, Pass::Resident));
    out.push_back(event_cmd(Op::Wait, ev.release_missing, v));
    out.push_back(pass_cmd(p, Op::GateUp, Pass::Missing));
    out.push_back(pass_cmd(p, Op::Down, Pass::Missing));
  } else {
    for (std::uint32_t w = 0; w < p.max_waves; ++w) {
      out.push_back(event_cmd(Op::Wait, ev.wave_release, first_wave + w));
      out.push_back(pass_cmd(p, Op::MoeMM));
      out.push_back(wave_done_cmd(p, ev, first_wave + w));
    }
  }
  out.push_back(cmd(Op::Combine, p.layer, p.rows));
  out.push_back(done_cmd(p, ev, v));
}

void encode_step(const ChunkPlan& p, Step step, const HandshakeEvents& ev, std::uint64_t value,
                 std::vector<Command>& out) {
  out.clear();
  switch (step) {
    case Step::ResidentPass:
      out.push_back(cmd(Op::Plan, p.layer, p.rows));
      out.push_back(pass_cmd(p, Op::GateUp, Pass::Resident));
      out.push_back(pass_cmd(p, Op::Down, Pass::Resident));
      return;
    case Step::MissingPass:
      out.push_back(pass_cmd(p, Op::GateUp, Pass::Missing));
      out.push_back(pass_cmd(p, Op::Down, Pass::Missing));
      out.push_back(cmd(Op::Combine, p.layer, p.rows));
      out.push_back(done_cmd(p, ev, value));
      return;
    case Step::Wave:
      out.push_back(pass_cmd(p, Op::MoeMM));
      out.push_back(wave_done_cmd(p, ev, value));
      return;
    case Step::Finish:
      out.push_back(cmd(Op::Combine, p.layer, p.rows));
      out.push_back(done_cmd(p, ev, value));
      return;
  }
}

}  // namespace strata
