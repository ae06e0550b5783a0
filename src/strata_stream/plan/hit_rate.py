"""The hit rate an arena can expect: a routing trace replayed through the engine's residency code
(trace/replay.py) at that arena.

Which trace: one given (`--trace`), else one recorded of this model beside its cached pack
(`<pack>.trace.csv`: run the model once with STRATA_TRACE_PATH set to that path), else the
shipped Qwen3-30B-A3B trace (one real conversation, 48 layers x 128 experts, top-6). A trace of
another geometry is replayed at the same share of all experts resident: an arena holding a
fraction f of this model's experts is taken to hit as often as one holding f of the trace's.
That carries the trace model's routing skew and reuse over to this one, which is the estimate's
main uncertainty (a model whose router spreads its choices more evenly hits less).
The replay runs the trace's whole conversation (its prompt, then its decode steps). The hit
rate plan gives leaves out each expert's first use, a miss in any arena (a cold arena's
compulsory reads, which a long conversation spreads thin): hits / (uses - distinct experts
used). Every expert resident then hits 1.0, as decode does once the arena is warm.
`cold_hit_rate` is the replay's own figure, every use counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from strata_stream.config import StreamConfig
from strata_stream.pack.geometry import Geometry
from strata_stream.trace.format import Trace, read_trace

REFERENCE_TRACE = Path(__file__).with_name("qwen3-30b-a3b.trace.csv")
REFERENCE_NAME = "Qwen3-30B-A3B"


def recorded_trace_path(pack: Path) -> Path:
    """Where plan looks for a recorded trace of a model: beside its pack, `<pack>.trace.csv`."""
    return pack.with_name(pack.name + ".trace.csv")


@dataclass(frozen=True)
class HitEstimate:
    hit_rate: float  # first uses left out (see the module)
    cold_hit_rate: float  # every use counted
    trace: str  # the file replayed
    kind: str  # "given", "recorded" (beside the pack) or "reference" (the shipped Qwen3 trace)
    trace_slots: int  # the arena replayed, in the trace's slots
    scaled: bool  # the trace's geometry is not the model's: replayed at the same share
    policy: str
    # Distinct experts the trace uses: an arena of as many slots never evicts while replaying
    # it, so it hits 1.0 there whatever a longer conversation would do.
    trace_experts_used: int = 0

    @property
    def saturated(self) -> bool:
        return self.trace_slots >= self.trace_experts_used

    def describe(self) -> str:
        what = {
            "given": f"the trace {self.trace}",
            "recorded": f"this model's recorded trace {self.trace}",
            "reference": f"the shipped {REFERENCE_NAME} trace (no trace of this model)",
        }[self.kind]
        how = " scaled to this geometry (same share of experts resident)" if self.scaled else ""
        return f"{what}{how}, {self.trace_slots} slots, {self.policy}"


def trace_slots(geometry: Geometry, slots: int, trace: Trace) -> tuple[int, bool]:
    """The trace's arena for `slots` of this geometry: the same slots where the geometry is the
    trace's, else the same share of all experts, within the replay's bounds (2 x top-k up to
    every expert)."""
    same = (geometry.n_layers, geometry.n_experts, geometry.top_k) == (
        trace.n_layers,
        trace.n_experts,
        trace.top_k,
    )
    everything = trace.n_layers * trace.n_experts
    n = slots if same else round(slots / geometry.n_records * everything)
    return max(2 * trace.top_k, min(everything, n)), not same


def expected_hit_rate(
    geometry: Geometry,
    slots: int,
    trace_path: str | Path | None = None,
    recorded: Path | None = None,
    cache_dir: Path | None = None,
) -> HitEstimate:
    """The replayed hit rate of `slots` for a model of `geometry`. `trace_path`: a trace the
    user gave; `recorded`: where this model's recorded trace would be (used if it exists)."""
    from strata_stream.trace.replay import replay  # imports the engine

    if trace_path is not None:
        path, kind = Path(trace_path), "given"
    elif recorded is not None and recorded.is_file():
        path, kind = recorded, "recorded"
    else:
        path, kind = REFERENCE_TRACE, "reference"
    trace = read_trace(path)
    policy = StreamConfig.from_env().eviction
    n, scaled = trace_slots(geometry, slots, trace)
    result = replay(trace, n, policy, cache_dir=cache_dir)
    keys = trace.accesses()
    hits = result.hit_rate * len(keys)
    warm = len(keys) - len(set(keys))  # uses after each expert's first
    hit = min(1.0, hits / warm) if warm else 1.0
    return HitEstimate(hit, result.hit_rate, str(path), kind, n, scaled, policy, len(set(keys)))


__all__ = [
    "REFERENCE_TRACE",
    "HitEstimate",
    "expected_hit_rate",
    "recorded_trace_path",
    "trace_slots",
]
