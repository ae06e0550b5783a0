"""`strata-stream plan`: a model's bytes, its arena, hit rate and decode speed, before it is
downloaded or converted (see docs/plan.md)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from strata_stream.doctor.saved import DoctorResult, load_result
from strata_stream.plan.arena import ArenaPlan, plan_arena
from strata_stream.plan.hit_rate import HitEstimate, expected_hit_rate, recorded_trace_path
from strata_stream.plan.model_bytes import ModelBytes, model_bytes
from strata_stream.plan.speed import DecodeSpeed, Rate, decode_speed, memory_rate, read_rate
from strata_stream.units import human_bytes


@dataclass(frozen=True)
class Plan:
    model: ModelBytes
    arena: ArenaPlan
    hit: HitEstimate | None  # None where no arena fits
    read: Rate | None
    memory_read: Rate | None
    speed: DecodeSpeed | None
    compute_given: bool

    def to_json(self) -> dict[str, Any]:
        def finite(x: float) -> float | None:
            return x if math.isfinite(x) else None

        m = self.model
        out: dict[str, Any] = {
            "model": m.source,
            "model_type": m.model_type,
            "geometry": m.geometry.to_dict(),
            "dense_bytes": m.dense_bytes,
            "expert_bytes": m.expert_bytes,
            "embedding_bytes": m.embedding_bytes,
            "pack_formats": [asdict(f) for f in m.formats],
            "arena": asdict(self.arena),
            "hit": None
            if self.hit is None
            else {**asdict(self.hit), "describe": self.hit.describe()},
        }
        if self.speed is not None and self.read is not None and self.memory_read is not None:
            s = self.speed
            out["read_rate"] = asdict(self.read)
            out["memory_read_rate"] = asdict(self.memory_read)
            out["compute_given"] = self.compute_given
            out["decode"] = {
                "misses_per_token": s.misses_per_token,
                "read_bytes_per_token": s.read_bytes_per_token,
                "compute_bytes_per_token": s.compute_bytes_per_token,
                "io_ceiling_tps": finite(s.io_ceiling),
                "misses_per_token_cold": s.misses_per_token_cold,
                "io_ceiling_cold_tps": finite(s.io_ceiling_cold),
                "compute_ceiling_tps": s.compute_ceiling,
                "predicted_tps": [s.low, s.high],
            }
        return out


def make_plan(
    model: str,
    memory: int | None = None,
    arena: int | None = None,
    disk_gbps: float | None = None,
    compute_tps: float | None = None,
    trace: str | Path | None = None,
    doctor: DoctorResult | None = None,
    use_saved_doctor: bool = True,
) -> Plan:
    """Everything `plan` prints. `memory`: bytes the process can have (default: this machine's
    available memory); `arena`: an arena size instead (generate's --arena-gb); `doctor`: the
    measurement to read rates from (default: the saved one, if `use_saved_doctor`)."""
    m = model_bytes(model)
    if doctor is None and use_saved_doctor:
        doctor = load_result()
    pack = m.pack
    a = plan_arena(m.geometry, pack.record_stride, m.dense_bytes, memory, arena)
    if a.arena_bytes is None:
        return Plan(m, a, None, None, None, None, compute_tps is not None)
    recorded = None
    local = Path(m.source)
    if local.is_dir():
        from strata_stream.convert.pack_cache import default_pack_path

        recorded = recorded_trace_path(default_pack_path(local))
    hit = expected_hit_rate(m.geometry, a.slots, trace, recorded)
    rd = read_rate(pack.pack_bytes, a.memory, pack.record_stride, disk_gbps, doctor)
    mem = memory_rate(doctor)
    speed = decode_speed(
        hit.hit_rate,
        m.geometry.n_layers,
        m.geometry.top_k,
        pack.record_bytes,
        pack.record_stride,
        m.dense_bytes - m.embedding_bytes,
        rd,
        mem,
        compute_tps,
        hit.cold_hit_rate,
    )
    return Plan(m, a, hit, rd, mem, speed, compute_tps is not None)


def _tps(x: float) -> str:
    return "unbounded (nothing is read)" if not math.isfinite(x) else f"{x:,.1f} tok/s"


def format_plan(p: Plan) -> str:
    m, g, a = p.model, p.model.geometry, p.arena
    lines = [
        f"model           {m.source} ({m.model_type})",
        f"geometry        {g.n_layers} MoE layers x {g.n_experts} experts, top-{g.top_k}, "
        f"hidden {g.hidden}, moe_intermediate {g.moe_intermediate}",
        f"dense bytes     {human_bytes(m.dense_bytes)} ({m.dense_bytes:,}): held in memory",
        f"expert bytes    {human_bytes(m.expert_bytes)} ({m.expert_bytes:,}) as stored",
        "pack            format              record      stride      pack file",
    ]
    for i, f in enumerate(m.formats):
        mark = "convert writes this; plan uses it" if i == 0 else f.converted_by
        lines.append(
            f"                {f.name:<19} {human_bytes(f.record_bytes):<11} "
            f"{human_bytes(f.record_stride):<11} {human_bytes(f.pack_bytes):<11} ({mark})"
        )
    source = "given" if a.memory_given else "available here now"
    lines.append(
        f"memory          {human_bytes(a.memory)} ({source}); "
        f"{human_bytes(max(0, a.available))} after the dense weights"
    )
    if a.arena_bytes is None:
        lines.append(f"arena           does not fit: {a.why}")
        return "\n".join(lines)
    share = a.slots / a.all_slots
    lines.append(
        f"arena           {human_bytes(a.arena_bytes)}: {a.slots:,} of {a.all_slots:,} "
        f"expert slots ({share:.1%} of the experts)"
    )
    assert p.hit is not None and p.speed is not None and p.read is not None
    assert p.memory_read is not None
    s = p.speed
    lines += [
        f"hit rate        {p.hit.hit_rate:.3f} ({p.hit.cold_hit_rate:.3f} counting each expert's "
        f"first use), replaying {p.hit.describe()}",
        *(
            [
                f"                the trace uses {p.hit.trace_experts_used:,} experts, no more "
                "than the arena holds: it never evicts, a longer conversation would"
            ]
            if p.hit.saturated and a.slots < a.all_slots
            else []
        ),
        f"reads           {s.misses_per_token:.1f} records a token "
        f"({human_bytes(s.read_bytes_per_token)}) at {p.read.bytes_per_s / 1e9:.2f} GB/s: "
        f"{p.read.source}",
        f"IO ceiling      {_tps(s.io_ceiling)} ({_tps(s.io_ceiling_cold)} counting first uses)",
    ]
    if p.compute_given:
        lines.append(f"compute ceiling {_tps(s.compute_ceiling)} (given: --compute-tps)")
    else:
        lines.append(
            f"compute ceiling {_tps(s.compute_ceiling)}: "
            f"{human_bytes(s.compute_bytes_per_token)} of weights a token at "
            f"{p.memory_read.bytes_per_s / 1e9:.1f} GB/s ({p.memory_read.source})"
        )
    lines.append(
        f"decode          {s.low:,.1f} .. {s.high:,.1f} tok/s predicted (every read waited "
        "for, first uses counted .. every read overlapped with computation)"
    )
    if p.read.assumed or (p.memory_read.assumed and not p.compute_given):
        lines.append(
            "note            a rate above is assumed, not measured: run "
            "`strata-stream doctor` for this machine's"
        )
    return "\n".join(lines)


__all__ = ["Plan", "format_plan", "make_plan"]
