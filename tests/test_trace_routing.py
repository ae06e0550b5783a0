"""strata_stream.trace.routing: a streamed model choosing its experts by the real Qwen3 trace
(benchmarks/serve_load.py's default routing). Checked against the trace file itself: every
token's experts at every layer are one trace token's, the same token through the whole pass,
and the geometry must match."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402

from strata_stream.errors import ConfigError  # noqa: E402
from strata_stream.mlx_lm import load  # noqa: E402
from strata_stream.mlx_lm.random_model import make_chat_checkpoint, make_checkpoint  # noqa: E402
from strata_stream.trace.format import read_trace  # noqa: E402
from strata_stream.trace.routing import route_by_trace, trace_tokens  # noqa: E402

TRACE = Path(__file__).parent / "data" / "qwen3-30b-a3b.route.csv"


def test_trace_tokens_are_the_files_complete_tokens() -> None:
    trace = read_trace(TRACE)
    table = trace_tokens(trace)
    assert table.shape[1:] == (trace.n_layers, trace.top_k)
    # The decode steps (128) and the prompt's last token are complete; the other prompt tokens
    # lack the last layer.
    assert table.shape[0] == 129
    # Every row is a (layer, experts) step of the file, in the file's order of tokens.
    steps = [(layer, tuple(e)) for layer, e in trace.steps]
    flat = [(layer, tuple(int(e) for e in table[t, layer]))
            for t in range(table.shape[0]) for layer in range(trace.n_layers)]  # fmt: skip
    assert flat == steps[len(steps) - len(flat) :]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Any:
    dims = {"num_hidden_layers": 3, "num_experts": 128, "num_experts_per_tok": 6}
    path = make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("traced") / "m", dims=dims)
    model, tok = load(str(path), progress=False)
    router = route_by_trace(model, TRACE)
    yield model, tok, router
    model.strata_engine.close()


def test_every_token_takes_one_trace_tokens_experts_at_every_layer(traced: Any) -> None:
    model, _, router = traced
    engine = model.strata_engine
    seen: list[np.ndarray] = []

    window_call = engine.window.moe_routed

    def spy(layer: int, x: Any, ids: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(np.asarray(ids).reshape(-1, router.top_k))  # what the engine was given
        return window_call(layer, x, ids, *args, **kwargs)

    engine.window.moe_routed = spy
    try:
        model(mx.array([[3, 9, 14, 22, 5]]))
    finally:
        del engine.window.moe_routed
    assert len(seen) == len(engine.blocks)
    table = router.table
    for row in range(seen[0].shape[0]):
        # The trace tokens whose every layer matches this row's experts: at least one.
        matches = [
            t for t in range(table.shape[0])
            if all(sorted(seen[i][row]) == sorted(table[t, router.trace_layer[i]])
                   for i in range(len(seen)))
        ]  # fmt: skip
        assert matches, f"row {row} took experts no single trace token chose"
    assert router.trace_layer == [0, 24, 47]  # spread over the trace's depth


def test_a_model_of_another_geometry_is_refused(tmp_path: Path) -> None:
    path = make_chat_checkpoint(tmp_path / "tiny")  # 8 experts, top-2
    model, _ = load(str(path), progress=False)
    try:
        with pytest.raises(ConfigError, match="top-2 of 8 experts, the trace top-6 of 128"):
            route_by_trace(model, TRACE)
    finally:
        model.strata_engine.close()
