"""Replay a routing trace through the product's own Window and ExpertStream, without computing.

Every step drives the real C++ Window (`_core.replay_trace`: the handshake a model's calls run,
on a backend that computes nothing) over a stream with simulated IO (reads complete without
touching a file) and a geometry-only pack, so a replay costs memory bandwidth, not disk, and
cannot drift from the product. Next to the engine's hit rate it prints a plain-Python LRU (a
cross-check of the engine) and Belady's offline optimum.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from strata_stream.config import EVICTION_POLICIES, StreamConfig
from strata_stream.errors import ConfigError, PackError
from strata_stream.pack import Geometry, write_pack
from strata_stream.pack.header import PAGE
from strata_stream.pack.header import VERSION as PACK_VERSION
from strata_stream.paths import cache_dir as default_cache_dir
from strata_stream.stream import simulated
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
    """(hit rate, expert reads started per routed use) replayed through the product's own
    Window and ExpertStream, computing nothing (`_core.replay_trace`). Each step is the
    externally routed call a model makes for one token at one layer: the hit rate counts routed
    uses that found their expert resident or loading. With `predictions`, the step's call
    brings the predicted next-layer experts, which the handshake queues as speculative reads
    behind the urgent ones and retires to limbo when unchosen; reads are simulated, and every
    read queued lands before the next step, so a replay gives the same figures on every run."""
    if slots < 2 * trace.top_k:
        raise ConfigError(f"--slots {slots}: at least {2 * trace.top_k} (2 x top_k) needed")
    layers, ids = _passes(trace)
    pred = None
    if predictions is not None:
        pred = ids.copy()  # a step without a prediction is never given one (replay_trace)
        for i, guess in enumerate(predictions):
            if guess is not None:
                pred[i] = _row(guess, trace.top_k)

    pack = geometry_pack(trace, cache_dir or default_cache_dir())
    stride = PAGE  # the geometry pack's records are tiny: one page each
    config = StreamConfig(
        arena_bytes=slots * stride,
        io_threads=0,
        part_bytes=stride,
        direct_io=False,
        eviction=policy,
    )
    from strata_stream import _core

    with simulated(pack, config) as stream:
        if stream.record_stride != stride:
            raise PackError(f"{pack}: unexpected record stride {stream.record_stride}")
        counts = _core.replay_trace(stream._s, layers, ids, pred)
        uses = counts["hits"] + counts["misses"]
        reads = counts["misses"] + int(stream.stats()["spec_requests"])
    return counts["hits"] / max(1, uses), reads / max(1, uses)


def _row(experts: Sequence[int], top_k: int) -> list[int]:
    """A step's experts as one row of top_k ids: a step that chose fewer (a trace's repeated
    choice, counted once) repeats its first, which asks for nothing more."""
    return list(experts) + [experts[0]] * (top_k - len(experts))


def _passes(trace: Trace) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """The trace's steps as the Window takes them: token after token, each a pass over the
    layers from 0 in order, up to the last or short of it (llama.cpp leaves the last layer out
    for prompt tokens whose output nothing reads). ConfigError naming the step otherwise."""
    n = len(trace.steps)
    layers = np.empty(n, np.int32)
    ids = np.empty((n, trace.top_k), np.int32)
    expect = 0
    for i, (layer, experts) in enumerate(trace.steps):
        if layer != expect and layer != 0:
            raise ConfigError(
                f"trace step {i}: layer {layer} where a pass over the model expects layer "
                f"{expect} (replay runs each token through every layer in order)"
            )
        if not 0 < len(experts) <= trace.top_k:
            raise ConfigError(f"trace step {i}: {len(experts)} experts (top_k {trace.top_k})")
        layers[i] = layer
        ids[i] = _row(experts, trace.top_k)
        expect = (layer + 1) % trace.n_layers
    return layers, ids


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
