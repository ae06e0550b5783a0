// plan_chunk and the encoders, without a backend or a stream: the rules chunk_plan.h states.
#include <catch2/catch.hpp>

#include <algorithm>

#include "exec/chunk_plan.h"
#include "policy/prefetch_governor.h"

using namespace strata;

namespace {

PlanRules rules(bool two_layer_decode, bool two_layer_prompt) {
  PlanRules r;
  r.n_layers = 6;
  r.n_experts = 16;
  r.top_k = 2;
  r.decode_rows = 4;
  r.two_layer_decode = two_layer_decode;
  r.two_layer_prompt = two_layer_prompt;
  r.two_layer_max = 5;
  return r;
}

ChunkRequest request(CallKind kind, std::uint32_t layer, std::uint32_t rows) {
  ChunkRequest q;
  q.kind = kind;
  q.layer = layer;
  q.rows = rows;
  return q;
}

std::size_t count(const std::vector<Command>& cs, Op op) {
  return std::size_t(std::count_if(cs.begin(), cs.end(), [&](const Command& c) { return c.op == op; }));
}

constexpr CallKind kKinds[] = {CallKind::Engine, CallKind::Routed, CallKind::External};

}  // namespace

TEST_CASE("plan: decode-sized chunks take the decode executor, except on the external path") {
  const PlanRules r = rules(false, false);
  for (CallKind kind : kKinds) {
    const ChunkPlan small = plan_chunk(r, request(kind, 0, 4), 8, 3);
    CHECK(small.decode_sized);
    CHECK(small.executor == (kind == CallKind::External ? Executor::Waves : Executor::Decode));
    const ChunkPlan large = plan_chunk(r, request(kind, 0, 5), 8, 3);
    CHECK_FALSE(large.decode_sized);
    CHECK(large.executor == Executor::Waves);
    // Four rows whose experts could exceed a wave are not decode-sized either.
    CHECK_FALSE(plan_chunk(r, request(kind, 0, 4), 7, 3).decode_sized);
  }
}

TEST_CASE("plan: each two-layer flag alone applies to its chunk size on every path") {
  for (bool decode_flag : {false, true})
    for (bool prompt_flag : {false, true}) {
      const PlanRules r = rules(decode_flag, prompt_flag);
      for (CallKind kind : kKinds) {
        CHECK(plan_chunk(r, request(kind, 0, 1), 8, 3).predict ==
              Lookahead{true, decode_flag});
        CHECK(plan_chunk(r, request(kind, 0, 40), 8, 3).predict ==
              Lookahead{true, prompt_flag});
        // wants_predictions agrees with what every chunk of such a call plans.
        CHECK(call_lookahead(r, 0, 1, 1024, 8) == Lookahead{true, decode_flag});
        CHECK(call_lookahead(r, 0, 40, 1024, 8) == Lookahead{true, prompt_flag});
      }
    }
}

TEST_CASE("plan: a call's lookahead covers its last, smaller chunk") {
  const PlanRules r = rules(true, false);
  // 41 rows in chunks of 40: the last chunk of one row is decode-sized.
  CHECK(call_lookahead(r, 0, 41, 40, 8) == Lookahead{true, true});
  CHECK(call_lookahead(r, 0, 80, 40, 8) == Lookahead{true, false});
}

TEST_CASE("plan: no prediction beyond the last layer, and none the caller did not bring (I10)") {
  const PlanRules r = rules(true, true);
  CHECK(plan_chunk(r, request(CallKind::Engine, 3, 1), 8, 3).predict == Lookahead{true, true});
  CHECK(plan_chunk(r, request(CallKind::Engine, 4, 1), 8, 3).predict == Lookahead{true, false});
  CHECK(plan_chunk(r, request(CallKind::Engine, 5, 1), 8, 3).predict == Lookahead{false, false});
  ChunkRequest q = request(CallKind::Routed, 0, 1);
  q.has_pred1 = false;
  CHECK(plan_chunk(r, q, 8, 3).predict == Lookahead{false, true});
  q.has_pred1 = true;
  q.has_pred2 = false;
  CHECK(plan_chunk(r, q, 8, 3).predict == Lookahead{true, false});
  // The engine's own router always has its predictions.
  q.kind = CallKind::Engine;
  CHECK(plan_chunk(r, q, 8, 3).predict == Lookahead{true, true});
  PlanRules off = r;
  off.lookahead = false;
  CHECK(plan_chunk(off, request(CallKind::Engine, 0, 1), 8, 3).predict == Lookahead{});
  CHECK(call_lookahead(off, 0, 1, 1024, 8) == Lookahead{});
}

TEST_CASE("plan: one speculation budget and the two-layer cap travel with the plan") {
  const PlanRules r = rules(true, true);
  const ChunkPlan p = plan_chunk(r, request(CallKind::Engine, 0, 40), 8, 3);
  CHECK(p.spec_budget == 3);
  CHECK(p.two_layer_max == 5);
  CHECK(plan_chunk(r, request(CallKind::Engine, 0, 1), 8, PrefetchGovernor::kUnlimited)
            .spec_budget == PrefetchGovernor::kUnlimited);
}

TEST_CASE("plan: waves cover the chosen experts; the one-piece submission encodes the most") {
  const PlanRules r = rules(false, false);
  const ChunkPlan p = plan_chunk(r, request(CallKind::Engine, 0, 40), 6, 0);
  CHECK(p.max_waves == 3);  // at most 16 distinct experts, 6 a wave
  CHECK(p.waves(16) == 3);
  CHECK(p.waves(12) == 2);
  CHECK(p.waves(1) == 1);
  CHECK(plan_chunk(r, request(CallKind::Engine, 0, 1), 6, 0).waves(2) == 1);  // decode
  CHECK(plan_chunk(r, request(CallKind::External, 0, 40), 6, 0).max_waves == 0);
}

TEST_CASE("encode: the external path submits nothing; a routed split chunk nothing first") {
  SharedEvent routed, r1, r2, done, wr, wd;
  const HandshakeEvents ev{&routed, &r1, &r2, &done, &wr, &wd};
  std::vector<Command> out = {Command{}};
  for (bool split : {false, true}) {
    PlanRules r = rules(true, true);
    r.split_turn = split;
    for (std::uint32_t rows : {1u, 40u}) {
      const ChunkPlan ext = plan_chunk(r, request(CallKind::External, 0, rows), 8, 3);
      CHECK_FALSE(ext.device_before_host);
      encode_chunk(ext, ev, 1, 1, out);
      CHECK(out.empty());
      const ChunkPlan routed_plan = plan_chunk(r, request(CallKind::Routed, 0, rows), 8, 3);
      CHECK(routed_plan.device_before_host == !split);
      const ChunkPlan engine = plan_chunk(r, request(CallKind::Engine, 0, rows), 8, 3);
      CHECK(engine.device_before_host);
      encode_chunk(engine, ev, 7, 3, out);
      CHECK(count(out, Op::Route) == 1);
      CHECK(count(out, Op::RoutePredict) == 2);
      CHECK(out.at(count(out, Op::RoutePredict) + 1).op == Op::Signal);
      CHECK(out.at(count(out, Op::RoutePredict) + 1).event == &routed);
      CHECK(out.at(count(out, Op::RoutePredict) + 1).value == 7);
      if (split) CHECK(out.size() == 4);
    }
  }
}

TEST_CASE("encode: one-piece decode and waves wait on their events in order") {
  SharedEvent routed, r1, r2, done, wr, wd;
  const HandshakeEvents ev{&routed, &r1, &r2, &done, &wr, &wd};
  std::vector<Command> out;
  ChunkRequest q = request(CallKind::Routed, 2, 1);
  q.rounding.arithmetic = Arithmetic::MlxBfloat16;
  const ChunkPlan decode = plan_chunk(rules(false, false), q, 8, 0);
  encode_chunk(decode, ev, 5, 1, out);
  REQUIRE(out.size() == 10);  // signal, wait, plan, 2 passes, wait, 2 passes, combine, signal
  CHECK(out[0].op == Op::Signal);
  CHECK((out[1].op == Op::Wait && out[1].event == &r1 && out[1].value == 5));
  CHECK((out[5].op == Op::Wait && out[5].event == &r2 && out[5].value == 5));
  CHECK((out[9].op == Op::Signal && out[9].event == &done && out[9].value == 5));
  for (const Command& c : out)
    if (c.op == Op::GateUp || c.op == Op::Down) CHECK(c.rounding.arithmetic == Arithmetic::MlxBfloat16);
  const ChunkPlan waves = plan_chunk(rules(false, false), request(CallKind::Engine, 0, 40), 6, 0);
  encode_chunk(waves, ev, 5, 11, out);
  CHECK(count(out, Op::MoeMM) == 3);
  std::uint64_t want = 11;
  for (const Command& c : out)
    if (c.op == Op::Wait) CHECK((c.event == &wr && c.value == want++));
  encode_step(waves, Step::Wave, ev, 12, out);
  REQUIRE(out.size() == 2);
  CHECK((out[0].op == Op::MoeMM && out[1].event == &wd && out[1].value == 12));
}

TEST_CASE("encode: a queued routed chunk signals nothing before the host point, done queued") {
  SharedEvent routed, r1, r2, done, wr, wd;
  const HandshakeEvents ev{&routed, &r1, &r2, &done, &wr, &wd};
  std::vector<Command> out, steps;
  for (bool split : {false, true}) {
    PlanRules r = rules(false, false);
    r.split_turn = split;
    for (std::uint32_t rows : {1u, 40u}) {
      for (CallKind kind : kKinds) {
        ChunkRequest q = request(kind, 1, rows);
        q.queued_done = true;  // only a routed chunk may take it
        const ChunkPlan p = plan_chunk(r, q, 6, 0);
        const bool queued = kind == CallKind::Routed;
        CHECK(p.queued_done == queued);
        CHECK(p.routed_signal == (p.device_before_host && !queued));
        q.queued_done = false;
        const ChunkPlan before = plan_chunk(r, q, 6, 0);
        CHECK(before.routed_signal == before.device_before_host);  // unchanged without it
        if (kind == CallKind::External) continue;
        // Every done Signal of the chunk (one-piece, or its last split step) is queued; no
        // other Signal is, and a queued chunk's first submission has no routed Signal.
        encode_chunk(p, ev, 4, 2, out);
        std::vector<Command> all = out;
        for (Step s : {Step::ResidentPass, Step::MissingPass, Step::Wave, Step::Finish}) {
          if (!split) break;
          encode_step(p, s, ev, 4, steps);
          all.insert(all.end(), steps.begin(), steps.end());
        }
        std::size_t queued_dones = 0;
        for (const Command& c : all) {
          if (c.op != Op::Signal) continue;
          CHECK(c.queued == (queued && c.event == &done));
          CHECK_FALSE((queued && c.event == &routed));
          queued_dones += c.queued;
        }
        if (queued) CHECK(queued_dones == (split ? 2u : 1u));  // MissingPass and Finish steps
      }
    }
  }
}

TEST_CASE("plan: a routed chunk encodes the waves its experts need; one wave's done is queued") {
  SharedEvent routed, r1, r2, done, wr, wd;
  const HandshakeEvents ev{&routed, &r1, &r2, &done, &wr, &wd};
  std::vector<Command> out;
  for (bool split : {false, true}) {
    PlanRules r = rules(false, false);
    r.split_turn = split;
    r.decode_batch_rows = 16;  // 40 rows take the waves whatever their experts
    // 40 rows could choose all 16 experts (3 waves of 6); the caller's ids chose these many.
    for (std::uint32_t distinct : {0u, 5u, 6u, 7u, 16u}) {
      CAPTURE(split, distinct);
      ChunkRequest q = request(CallKind::Routed, 1, 40);
      q.distinct_experts = distinct;
      q.queued_done = true;
      const ChunkPlan p = plan_chunk(r, q, 6, 0);
      const std::uint32_t waves = distinct == 0 ? 3 : (distinct + 5) / 6;
      CHECK(p.max_waves == waves);
      if (distinct > 0) CHECK(p.waves(distinct) == p.max_waves);
      // After its only wave the host unpins nothing and releases no other wave: that wave's
      // wave_done is queued with the chunk's done. With more waves the host needs each one
      // finished before the next host point drops its protections.
      encode_chunk(p, ev, 4, 2, out);
      std::vector<Command> all = out;
      if (split) {  // the first submission has no wave; each wave is a step of its own
        encode_step(p, Step::Wave, ev, 2, out);
        all.insert(all.end(), out.begin(), out.end());
      }
      std::size_t wave_dones = 0;
      for (const Command& c : all)
        if (c.op == Op::Signal && c.event == &wd) {
          ++wave_dones;
          CHECK(c.queued == (waves == 1));
        }
      CHECK(wave_dones == (split ? 1u : waves));
      q.queued_done = false;
      encode_chunk(plan_chunk(r, q, 6, 0), ev, 4, 2, out);
      for (const Command& c : out) CHECK_FALSE(c.queued);  // never without the chunk's own
    }
  }
}
