"""`strata-stream serve`: an OpenAI-compatible HTTP server, with the Anthropic Messages API and
tool calls on both, and Prometheus metrics.

create_app(model, tokenizer, ServeConfig(model_id=...), stats=...) builds the FastAPI app;
serve(path, ...) loads a model and runs it (the CLI). See docs/serve.md."""

from __future__ import annotations

from strata_stream.engine_stats import STATS_KEYS, StatsSource, window_stats_source
from strata_stream.serve.app import create_app
from strata_stream.serve.command import serve
from strata_stream.serve.config import ServeConfig
from strata_stream.serve.server import BackgroundServer

__all__ = [
    "STATS_KEYS",
    "BackgroundServer",
    "ServeConfig",
    "StatsSource",
    "create_app",
    "serve",
    "window_stats_source",
]
