"""Replay a routing trace through the real ExpertStream residency code, without computing.

The stream runs with simulated IO (reads complete without touching a file) over a
geometry-only pack, so a replay costs memory bandwidth, not disk. Next to the engine's hit rate
it prints a plain-Python LRU (a cross-check of the engine) and Belady's offline optimum.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from strata_stream.config import EVICTION_POLICIES, StreamConfig
from strata_stream.errors import ConfigError, PackError
from strata_stream.pack import Geometry, write_pack
from strata_stream.pack.header import PAGE
from strata_stream.pack.header import VERSION as PACK_VERSION
from strata_stream.paths import cache_dir as default_cache_dir
from strata_stream import testing
from strata_stream.stream import simulated
from strata_stream.testing import run_io
from strata_stream.trace.format import Trace


@dataclass(frozen=True)
class ReplayResult:
    slots: int
    accesses: int
    hit_rate: float
    lru_hit_rate: float
    belady_hit_rate: float
    policy: str
    reads_per_access: float  # expert reads the engine started (urgent + speculative) per use
    prediction_recall: float | None = None  # modelled next-layer prediction, if any
    lru_predicted_hit_rate: float | None = None  # the engine's LRU with the same predictions


def lru_hit_rate(accesses: list[int], slots: int) -> float:
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for key in accesses:
        if key in cache:
            hits += 1
            cache.move_to_end(key)
            continue
        if len(cache) >= slots:
            cache.popitem(last=False)
        cache[key] = None
    return hits / max(1, len(accesses))


def belady_hit_rate(accesses: list[int], slots: int) -> float:
    """Offline optimum: evict the key whose next use is farthest away."""
    never = len(accesses) + 1
    next_use = [never] * len(accesses)
    seen: dict[int, int] = {}
    for i in range(len(accesses) - 1, -1, -1):
        next_use[i] = seen.get(accesses[i], never)
        seen[accesses[i]] = i
    cache: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = 0
    for i, key in enumerate(accesses):
        if key in cache:
            hits += 1
        elif len(cache) >= slots:
            while True:
                neg, victim = heapq.heappop(heap)
                if cache.get(victim) == -neg:
                    del cache[victim]
                    break
        cache[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return hits / max(1, len(accesses))


def geometry_pack(trace: Trace, directory: Path) -> Path:
    """A pack with the trace's layers and experts and tiny matrices: the residency code needs
    the geometry and record layout, not the weights."""
    # The format version in the name: a cache written by another version is not reused.
    path = directory / f"replay-v{PACK_VERSION}-{trace.n_layers}x{trace.n_experts}.strpk"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        g = Geometry(trace.n_layers, trace.n_experts, trace.top_k, 8, 8, "softmax_topk", True)
        zeros = np.zeros((8, 8), np.float32)
        write_pack(
            path,
            g,
            [np.zeros((trace.n_experts, 8), np.float32)] * trace.n_layers,
            lambda layer, e: (zeros, zeros, zeros),
            weight_format="f32",
            progress=False,
            source="strata-stream replay geometry",
        )
    return path


def predicted_steps(trace: Trace, recall: float, seed: int = 0) -> list[tuple[int, ...] | None]:
    """A model of router l+1 run on layer l's input, for traces that hold no hidden states.

    Entry i is the prediction made at step i for step i + 1 when that step is the next layer of
    the same token (else None): each expert step i + 1 really chose is kept with probability
    `recall` and otherwise replaced by an expert drawn uniformly from those it did not choose.
    Uniform wrong guesses are the pessimistic choice (a real router's misses tend to be popular
    experts, often resident anyway). Qwen3-30B-A3B's next-layer recall is reported as ~0.89.
    """
    if not 0.0 <= recall <= 1.0:
        raise ConfigError(f"prediction recall must be in [0, 1], got {recall}")
    rng = np.random.default_rng(seed)
    out: list[tuple[int, ...] | None] = []
    steps = trace.steps
    for i, (layer, _) in enumerate(steps):
        if i + 1 >= len(steps) or steps[i + 1][0] != layer + 1:
            out.append(None)
            continue
        actual = steps[i + 1][1]
        others = np.setdiff1d(np.arange(trace.n_experts), actual)
        guess = [e if rng.random() < recall else -1 for e in actual]
        wrong = rng.choice(others, size=guess.count(-1), replace=False)
        fill = iter(int(e) for e in wrong)
        out.append(tuple(e if e >= 0 else next(fill) for e in guess))
    return out


def engine_hit_rate(
    trace: Trace,
    slots: int,
    policy: str,
    predictions: Sequence[tuple[int, ...] | None] | None = None,
    cache_dir: Path | None = None,
) -> tuple[float, float]:
    """(hit rate, expert reads started per routed use) replayed through the real
    ExpertStream. The hit rate counts routed uses that found their expert resident or loading,
    With `predictions` each step runs the decode handshake: the routed experts
    urgently, then the predicted next-layer experts as speculative reads that complete before
    the next step (simulated IO is instant), then retirement of unchosen predictions."""
    if slots < 2 * trace.top_k:
        raise ConfigError(f"--slots {slots}: at least {2 * trace.top_k} (2 x top_k) needed")

    pack = geometry_pack(trace, cache_dir or default_cache_dir())
    stride = PAGE  # the geometry pack's records are tiny: one page each
    config = StreamConfig(
        arena_bytes=slots * stride,
        io_threads=0,
        part_bytes=stride,
        direct_io=False,
        eviction=policy,
    )
    hits = misses = 0
    with simulated(pack, config) as stream:
        if stream.record_stride != stride:
            raise PackError(f"{pack}: unexpected record stride {stream.record_stride}")
        for i, (layer, experts) in enumerate(trace.steps):
            testing.enter_layer(stream, layer, experts)  # the device reads these: protected (I4)
            h, m, _ = testing.request(stream, layer, experts)
            hits += h
            misses += m
            guess = predictions[i] if predictions is not None else None
            if guess is not None:
                testing.publish(stream, layer)
                testing.request(stream, layer + 1, guess, urgent=False)
            testing.wait(stream, layer, experts)
            if predictions is not None:
                testing.after_layer(stream, layer)
                testing.retire_unused_pre(stream, layer, experts)
                testing.release_limbo(stream)
                # Manual IO (io_threads=0), as the tests drive it: speculative reads land
                # before the next step.
                while run_io(stream):
                    pass
        testing.end_turn(stream)
        reads = misses + int(stream.stats()["spec_requests"])
    return hits / max(1, hits + misses), reads / max(1, hits + misses)


def replay(
    trace: Trace,
    slots: int,
    policy: str = "decayed_lfu",
    cache_dir: Path | None = None,
    recall: float | None = None,
    seed: int = 0,
) -> ReplayResult:
    """Hit rate of the engine with `policy`, beside LRU and Belady on the same accesses.

    With `recall`, the engine also prefetches modelled next-layer predictions
    (`predicted_steps`); `lru_predicted_hit_rate` then gives the engine's LRU policy under the
    same predictions. LRU and Belady themselves never prefetch: they bound the policy alone.
    """
    if policy not in EVICTION_POLICIES:
        raise ConfigError(
            f"policy {policy!r} is not available (have: {', '.join(EVICTION_POLICIES)})"
        )
    predictions = predicted_steps(trace, recall, seed) if recall is not None else None
    keys = trace.accesses()
    hit_rate, reads = engine_hit_rate(trace, slots, policy, predictions, cache_dir)
    lru_predicted = None
    if predictions is not None:
        lru_predicted = engine_hit_rate(trace, slots, "lru", predictions, cache_dir)[0]
    return ReplayResult(
        slots,
        len(keys),
        hit_rate,
        lru_hit_rate(keys, slots),
        belady_hit_rate(keys, slots),
        policy,
        reads,
        recall,
        lru_predicted,
    )
