"""`strata-stream serve`: an OpenAI-compatible HTTP server, with the Anthropic Messages API and
tool calls on both, and Prometheus metrics.

create_app(model, tokenizer, ServeConfig(model_id=...), stats=...) builds the FastAPI app;
serve(path, ...) loads a model and runs it (the CLI). See docs/serve.md.

The names below load on first use, so the package's modules that need no HTTP stack (the
continuous batchers, the cache helpers) import where the `[serve]` extra is not installed."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strata_stream.engine_stats import STATS_KEYS, StatsSource, window_stats_source
    from strata_stream.serve.app import create_app
    from strata_stream.serve.command import serve
    from strata_stream.serve.config import ServeConfig
    from strata_stream.serve.server import BackgroundServer

_WHERE = {
    "STATS_KEYS": "strata_stream.engine_stats",
    "StatsSource": "strata_stream.engine_stats",
    "window_stats_source": "strata_stream.engine_stats",
    "create_app": "strata_stream.serve.app",
    "serve": "strata_stream.serve.command",
    "ServeConfig": "strata_stream.serve.config",
    "BackgroundServer": "strata_stream.serve.server",
}

__all__ = [
    "STATS_KEYS",
    "BackgroundServer",
    "ServeConfig",
    "StatsSource",
    "create_app",
    "serve",
    "window_stats_source",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
