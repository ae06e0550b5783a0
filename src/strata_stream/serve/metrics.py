"""Prometheus metrics of one server instance, in a registry of its own (never the global one),
so several servers in one process (tests, benchmarks) do not mix their counts."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Time to first token spans ~1 ms (tiny model, warm) to minutes (long prompt, cold arena).
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# Sequences per decode step: powers of two up to the largest batch worth serving.
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class EngineCollector(Collector):
    """Exports the last streaming-engine snapshot (schema in engine_stats.py) at scrape time."""

    def __init__(self, snapshot: Callable[[], Mapping[str, Any] | None]) -> None:
        self._snapshot = snapshot

    def describe(self) -> Iterable[Metric]:
        return []  # families depend on the snapshot; no auto-describe call into the engine

    def collect(self) -> Iterable[Metric]:
        s = self._snapshot()
        if s is None:
            return

        def num(key: str) -> float | None:
            v = s.get(key)
            return None if v is None else float(v)

        def counter(name: str, doc: str, key: str) -> None:
            v = num(key)
            if v is not None:
                out.append(CounterMetricFamily(name, doc, value=v))

        def gauge(name: str, doc: str, v: float | None) -> None:
            if v is not None:
                out.append(GaugeMetricFamily(name, doc, value=v))

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a is not None and b else None

        out: list[Metric] = []
        counter("strata_expert_hits", "Expert look-ups found resident in the arena.", "hits")
        counter("strata_expert_misses", "Expert look-ups that had to be read.", "misses")
        counter(
            "strata_expert_bytes_read", "Bytes read from the pack into the arena.", "bytes_read"
        )
        counter(
            "strata_expert_stall_seconds", "Seconds compute waited for expert reads.", "stall_s"
        )
        hits, misses = num("hits"), num("misses")
        looked = None if hits is None or misses is None else hits + misses
        gauge("strata_expert_hit_rate", "Expert hits / look-ups since start.", ratio(hits, looked))
        gauge(
            "strata_arena_slots_in_use",
            "Arena slots holding or reading an expert.",
            num("slots_in_use"),
        )
        gauge("strata_arena_slots", "Arena size in expert slots.", num("slots_total"))
        correct = num("pred_correct")
        gauge(
            "strata_prefetch_precision",
            "Next-layer predictions that were then used / made.",
            ratio(correct, num("pred_predicted")),
        )
        gauge(
            "strata_prefetch_recall",
            "Routed experts that had been predicted / routed.",
            ratio(correct, num("pred_actual")),
        )
        counter(
            "strata_expert_routed",
            "Expert choices summed over the rows (sequences, prompt tokens) of every call.",
            "routed",
        )
        routed = num("routed")
        gauge(
            "strata_expert_sharing",
            "Expert choices per expert looked up: above 1 when rows of a call share experts.",
            ratio(routed, looked),
        )
        per_layer = s.get("per_layer_hit_rate")
        if per_layer is not None:
            fam = GaugeMetricFamily(
                "strata_expert_layer_hit_rate",
                "Expert hit rate of one MoE layer.",
                labels=["layer"],
            )
            for layer, rate in enumerate(per_layer):
                if rate is not None:
                    fam.add_metric([str(layer)], float(rate))
            out.append(fam)
        yield from out


class ServerMetrics:
    """The serving counters; safe to update from any thread (prometheus_client locks)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "strata_serve_requests",
            "HTTP requests answered, by route and status code.",
            ["route", "status"],
            registry=r,
        )
        self.generations = Counter(
            "strata_serve_generations",
            "Generations finished, by finish reason "
            "(stop, length, cancelled: the client went away, error).",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "strata_serve_prompt_tokens", "Prompt tokens processed.", registry=r
        )
        self.generated_tokens = Counter(
            "strata_serve_generated_tokens", "Tokens generated (sampled), all requests.", registry=r
        )
        self.prompt_tps = Gauge(
            "strata_serve_prompt_tokens_per_second",
            "Prompt processing speed of the last request.",
            registry=r,
        )
        self.decode_tps = Gauge(
            "strata_serve_decode_tokens_per_second",
            "Decode speed (tokens after the first / seconds) of the last request.",
            registry=r,
        )
        self.ttft = Histogram(
            "strata_serve_time_to_first_token_seconds",
            "From the worker taking a request to its first token (excludes queueing).",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "strata_serve_queue_wait_seconds",
            "Time requests waited in the queue.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge(
            "strata_serve_queue_depth", "Requests waiting for the generation worker.", registry=r
        )
        self.queue_capacity = Gauge(
            "strata_serve_queue_capacity",
            "Waiting requests accepted before answering 503.",
            registry=r,
        )
        self.batch_size = Histogram(
            "strata_serve_batch_size",
            "Sequences decoded together per decode step.",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.busy = Gauge(
            "strata_serve_worker_busy", "1 while the worker has sequences in its batch.", registry=r
        )
        self.prompt_cache_hits = Counter(
            "strata_serve_prompt_cache_hits",
            "Requests whose prompt started from a kept prompt cache.",
            registry=r,
        )
        self.prompt_cache_misses = Counter(
            "strata_serve_prompt_cache_misses",
            "Requests no kept prompt cache served (the whole prompt was read).",
            registry=r,
        )
        self.prompt_cache_tokens = Counter(
            "strata_serve_prompt_cache_tokens",
            "Prompt tokens served from kept prompt caches instead of being read.",
            registry=r,
        )
        self.prompt_cache_refused = Counter(
            "strata_serve_prompt_cache_refused",
            "Prompt cache files refused at use (corrupted, truncated or not this model's).",
            registry=r,
        )
        self.prompt_cache_bytes = Gauge(
            "strata_serve_prompt_cache_bytes",
            "Bytes of prompt caches kept in memory.",
            registry=r,
        )
        self.prompt_cache_disk_bytes = Gauge(
            "strata_serve_prompt_cache_disk_bytes",
            "Bytes of this model's prompt cache files in the prompt cache directory.",
            registry=r,
        )
        self.stats_errors = Counter(
            "strata_serve_stats_errors", "Stats-source calls that raised.", registry=r
        )
        self._lock = threading.Lock()  # guards _engine_snapshot
        self._engine_snapshot: Mapping[str, Any] | None = None
        r.register(EngineCollector(self.engine_snapshot))

    def set_engine_snapshot(self, snapshot: Mapping[str, Any] | None) -> None:
        with self._lock:
            self._engine_snapshot = snapshot

    def engine_snapshot(self) -> Mapping[str, Any] | None:
        with self._lock:
            return self._engine_snapshot

    def render(self) -> bytes:
        return generate_latest(self.registry)
