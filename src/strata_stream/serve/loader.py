"""Loading the model to serve: strata_stream.mlx_lm.load (the experts stream from a pack), and
the engine's figures for /metrics."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from strata_stream.engine_stats import StatsSource


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    stats: StatsSource


def load_for_serving(
    path: str,
    *,
    arena_bytes: int | None = None,
    pack_path: str | os.PathLike[str] | None = None,
) -> LoadedModel:
    """strata_stream.mlx_lm.load(path, arena_bytes=..., pack_path=...) and its stats source."""
    # Imported here: it needs mlx, which building the app (tests, other front-ends) does not.
    from strata_stream.mlx_lm import load, stats_source

    model, tokenizer = load(path, arena_bytes=arena_bytes, pack_path=pack_path)
    return LoadedModel(model, tokenizer, stats_source(model))
