"""The streaming-engine figures a server exports, and how a Window provides them.

Beside the server (strata_stream.serve), not in it: a loaded model gives its figures in this
schema (strata_stream.mlx_lm.stats_source) without importing the server's FastAPI stack.

A stats source is any `Callable[[], Mapping[str, Any]]` returning a snapshot with these keys
(every key optional; a missing or None value leaves its metric out):

  hits, misses         int, cumulative: expert look-ups found resident / not resident
  bytes_read           int, cumulative: bytes read from the pack into the arena
  stall_s              float, cumulative: seconds compute waited for expert reads
  slots_in_use         int, now: arena slots not free (reading, complete or parked)
  slots_total          int: arena size in expert slots
  pred_correct         int, cumulative: next-layer predictions that were then routed to
  pred_predicted       int, cumulative: next-layer predictions made
  pred_actual          int, cumulative: experts actually routed to where predictions were made
  per_layer_hit_rate   list[float | None]: hit rate of each MoE layer (None: no look-ups yet)
  routed               int, cumulative: expert choices summed over every row of every call
                       (tokens x top_k). Against hits + misses (each call looks up the union
                       of its rows' experts once) it is the sharing a batch gets

The server calls the source only from its generation worker thread (at start-up, every
`ServeConfig.stats_interval_s` while generating and after each request), never from an HTTP
thread, so the engine behind it is never entered by two threads at once; /metrics reads the
last snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

StatsSource = Callable[[], Mapping[str, Any]]

STATS_KEYS = (
    "hits",
    "misses",
    "bytes_read",
    "stall_s",
    "slots_in_use",
    "slots_total",
    "pred_correct",
    "pred_predicted",
    "pred_actual",
    "per_layer_hit_rate",
    "routed",
)


def window_snapshot(
    window_stats: Mapping[str, Any], slot_states: Any, n_slots: int, top_k: int | None = None
) -> dict[str, Any]:
    """Maps `Window.stats()` and the stream's slot table `state` column onto the schema."""
    total = window_stats["total"]
    per_layer: list[float | None] = []
    for d in window_stats["layers"]:
        looked = int(d["hits"]) + int(d["misses"])
        per_layer.append(int(d["hits"]) / looked if looked else None)
    # SlotState::Free is 0 (csrc/engine/residency/slot.h); every other state holds arena bytes.
    in_use = int(np.count_nonzero(np.asarray(slot_states) != 0))
    return {
        "hits": int(total["hits"]),
        "misses": int(total["misses"]),
        "bytes_read": int(total["bytes_read"]),
        "stall_s": float(total["stall_seconds"]),
        "slots_in_use": in_use,
        "slots_total": int(n_slots),
        "pred_correct": int(total["pred_correct"]),
        "pred_predicted": int(total["pred_predicted"]),
        "pred_actual": int(total["pred_actual"]),
        "per_layer_hit_rate": per_layer,
        "routed": None if top_k is None else int(total["tokens"]) * top_k,
    }


def window_stats_source(window: Any) -> StatsSource:
    """A stats source over a `strata_stream.Window` (and its `ExpertStream`)."""

    def snapshot() -> Mapping[str, Any]:
        stream = window.stream
        return window_snapshot(window.stats(), stream.slot_table()["state"], stream.n_slots,
                               stream.top_k)  # fmt: skip

    return snapshot
