"""Loading the model to serve: through strata_stream.mlx_lm (expert streaming) when it is
installed, else plain mlx_lm.load, which serves the model without streaming metrics."""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any

from strata_stream.serve.stats import StatsSource

log = logging.getLogger("strata_stream.serve")


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    stats: StatsSource | None
    streaming: bool


def load_for_serving(path: str, *, arena_bytes: int | None = None) -> LoadedModel:
    """strata_stream.mlx_lm.load(path, arena_bytes=...) when that module exists; its
    `stats_source(model)` (when it has one) feeds the engine metrics. A missing module falls
    back to mlx_lm.load with a log line; a module that exists but fails to import raises."""
    if importlib.util.find_spec("strata_stream.mlx_lm") is None:
        log.warning(
            "strata_stream.mlx_lm is not available: serving %s with plain mlx_lm.load "
            "(no expert streaming, no engine metrics%s)",
            path,
            "; --arena-gb ignored" if arena_bytes is not None else "",
        )
        import mlx_lm

        loaded = mlx_lm.load(path)
        return LoadedModel(loaded[0], loaded[1], None, streaming=False)
    ss = importlib.import_module("strata_stream.mlx_lm")
    model, tokenizer = ss.load(path, arena_bytes=arena_bytes)
    make_stats = getattr(ss, "stats_source", None)
    stats = make_stats(model) if make_stats is not None else None
    if stats is None:
        log.warning("strata_stream.mlx_lm gives no stats_source(model): no engine metrics")
    return LoadedModel(model, tokenizer, stats, streaming=True)
