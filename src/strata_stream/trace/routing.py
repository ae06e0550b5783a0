"""Route a streamed mlx-lm model by a real routing trace instead of its own gates (load tests).

A random-weight model routes concentrated: a few experts win for almost every token, so a
batch's rows share nearly all their experts and a load test flatters batching. `route_by_trace`
makes every MoE block of a model loaded by `strata_stream.mlx_lm.load` choose its experts from
a trace of a real model (tests/data's Qwen3-30B-A3B conversation, 48 layers x 128 experts,
top-6): each token of a forward pass takes the experts one token of the trace chose, model
layer l those of trace layer round(l * (L_trace - 1) / (L - 1)), so the layers keep the trace's
own spread from its first layers (almost uniform) to its middle ones (a few dozen experts).

Which trace token a row takes is a hash of the row's input to the first MoE block (its bytes:
a function of the token and its context alone), kept for the pass's later layers and for the
engine's next-layer predictions (which are therefore exact: the trace has no hidden states to
predict from). Rows of a batch hence take independent tokens of the one conversation the trace
holds: they overlap as tokens of one conversation do, which is more than different
conversations would (benchmarks/batch_union.py reads the same trace the same way). The weights
are the block's own, for the experts its gate chose: the trace decides which experts are read
and computed, which is what a load test measures, not what the mixture weighs.

The model must have the trace's number of experts (and at least its top-k per token).
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from strata_stream.errors import ConfigError
from strata_stream.trace.format import Trace, read_trace


def trace_tokens(trace: Trace) -> npt.NDArray[np.int32]:
    """The trace's complete tokens as [token, layer, k] expert ids (a token is complete when
    every layer routed it top-k experts; the trace leaves the last layer out of most prompt
    tokens)."""
    tokens: list[dict[int, tuple[int, ...]]] = []
    current: dict[int, tuple[int, ...]] = {}
    for layer, experts in trace.steps:
        if layer in current or (layer == 0 and current):
            tokens.append(current)
            current = {}
        current[layer] = experts
    tokens.append(current)
    full = [
        [t[layer] for layer in range(trace.n_layers)]
        for t in tokens
        if len(t) == trace.n_layers and all(len(e) == trace.top_k for e in t.values())
    ]
    if not full:
        raise ConfigError("the trace holds no token routed top-k at every layer")
    return np.asarray(full, dtype=np.int32)


class TraceRouter:
    """The experts of every MoE block of one model, chosen by a trace (see the module)."""

    def __init__(self, trace: Trace, n_model_layers: int) -> None:
        self.table = trace_tokens(trace)  # [token, trace layer, k]
        self.top_k = trace.top_k
        self.n_experts = trace.n_experts
        span = trace.n_layers - 1
        self.trace_layer = [
            round(i * span / max(n_model_layers - 1, 1)) for i in range(n_model_layers)
        ]
        # The trace token of each row of the pass in flight (set at pack layer 0).
        self._rows: npt.NDArray[np.int64] | None = None

    def rows_for(self, layer: int, x: Any) -> npt.NDArray[np.int64]:
        import mlx.core as mx

        n_rows = 1
        for d in x.shape[:-1]:
            n_rows *= int(d)
        if layer == 0 or self._rows is None or self._rows.size != n_rows:
            # float32 holds every bfloat16/float16 value exactly: distinct rows, distinct bytes.
            flat = np.asarray(x.reshape(-1, x.shape[-1]).astype(mx.float32))
            keys = [zlib.crc32(row.tobytes()) for row in flat]
            self._rows = np.asarray(keys, dtype=np.int64) % self.table.shape[0]
        return self._rows

    def route(self, layer: int, x: Any, indices: Any) -> Any:
        """The trace's ids in place of `indices` (the block's own choice, [..., k]) for the rows
        of x, the input of pack layer `layer`'s experts."""
        import mlx.core as mx

        rows = self.rows_for(layer, x)
        ids = self.table[rows, self.trace_layer[layer]]  # [rows, k]
        return mx.array(ids).reshape(*indices.shape[:-1], self.top_k)


def route_by_trace(model: Any, trace_path: str | Path) -> TraceRouter:
    """Makes the streamed `model` (strata_stream.mlx_lm.load, CPU experts) route by the trace:
    every block's routing and the engine's predictions. Returns the router."""
    engine = getattr(model, "strata_engine", None)
    if engine is None or engine.experts != "cpu":
        raise ConfigError("route_by_trace needs a model loaded by strata_stream.mlx_lm.load "
                          "with experts='cpu'")  # fmt: skip
    trace = read_trace(trace_path)
    n_experts = engine.stream.n_experts
    if n_experts != trace.n_experts or engine.top_k != trace.top_k:
        raise ConfigError(
            f"the model routes top-{engine.top_k} of {n_experts} experts, the trace top-"
            f"{trace.top_k} of {trace.n_experts}: build the model with the trace's geometry"
        )
    router = TraceRouter(trace, len(engine.blocks))
    engine.route_override = router.route
    return router


__all__ = ["TraceRouter", "route_by_trace", "trace_tokens"]
