"""Loading the model to serve, with its experts streamed from a pack, and the engine's figures
for /metrics: through strata_stream.mlx_lm.load (engine "mlx-lm") or
strata_stream.transformers.load (engine "transformers", the tokenizer AutoTokenizer's)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from strata_stream.engine_stats import StatsSource
from strata_stream.errors import ConfigError


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    stats: StatsSource
    engine: str = "mlx-lm"


def load_for_serving(
    path: str,
    *,
    arena_bytes: int | None = None,
    pack_path: str | os.PathLike[str] | None = None,
    engine: str = "mlx-lm",
    device: str | None = None,
) -> LoadedModel:
    """The engine's load(path, arena_bytes=..., pack_path=...) and its stats source. `device`
    (a torch device) is for the transformers engine."""
    # Imported here: each needs its framework, which building the app does not.
    if engine == "transformers":
        from transformers import AutoTokenizer

        from strata_stream.transformers import load as load_transformers
        from strata_stream.transformers import stats_source as transformers_stats

        model = load_transformers(path, arena_bytes=arena_bytes, pack_path=pack_path,
                                  device=device)  # fmt: skip
        try:
            tokenizer = AutoTokenizer.from_pretrained(model.strata_model_dir)
        except BaseException:
            model.strata_engine.close()
            raise
        return LoadedModel(model, tokenizer, transformers_stats(model), engine)
    if engine != "mlx-lm":
        raise ConfigError(f"engine must be mlx-lm or transformers, got {engine!r}")
    if device is not None:
        raise ConfigError("device is for the transformers engine")
    from strata_stream.mlx_lm import load, stats_source

    model, tokenizer = load(path, arena_bytes=arena_bytes, pack_path=pack_path)
    return LoadedModel(model, tokenizer, stats_source(model), engine)
