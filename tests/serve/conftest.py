"""A tiny random-weight qwen3_moe checkpoint, served on a free loopback port for the module."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("fastapi")
pytest.importorskip("openai")

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
import numpy as np  # noqa: E402

from serve.helpers import MODEL_ID, TIMEOUT_S, FakeStats, Served, client_for  # noqa: E402
from strata_stream.mlx_lm.random_model import make_chat_checkpoint  # noqa: E402
from strata_stream.serve import BackgroundServer, ServeConfig, create_app  # noqa: E402


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def oracle(tiny_path: Path) -> Callable[[list[int], int], str]:
    """Greedy text from mlx_lm.generate on its own copy of the model (never the served one,
    which only the server's worker thread may run)."""
    model, tokenizer = mlx_lm.load(str(tiny_path))

    def generate(prompt: list[int], max_tokens: int) -> str:
        return str(mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens))

    return generate


@pytest.fixture(scope="session")
def reference(tiny_path: Path) -> Callable[[list[int]], np.ndarray]:
    """reference(ids) -> [len(ids), vocab] log-softmax (float64) of plain mlx-lm's logits on
    its own copy of the model, teacher-forced on ids: row t scores the token after ids[t]."""
    model, _ = mlx_lm.load(str(tiny_path))

    def log_softmax(ids: list[int]) -> np.ndarray:
        logits = np.array(model(mx.array(ids)[None])[0].astype(mx.float32)).astype(np.float64)
        shifted = logits - logits.max(axis=-1, keepdims=True)
        out: np.ndarray = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
        return out

    return log_softmax


@pytest.fixture(scope="session")
def tokenizer(tiny_path: Path) -> Any:
    return mlx_lm.load(str(tiny_path))[1]


@pytest.fixture(scope="module")
def served(tiny_path: Path) -> Iterator[Served]:
    model, tokenizer = mlx_lm.load(str(tiny_path))
    stats = FakeStats()
    app = create_app(
        model,
        tokenizer,
        ServeConfig(model_id=MODEL_ID, max_queue=8, stats_interval_s=0.05),
        stats=stats,
    )
    with BackgroundServer(app, timeout_s=TIMEOUT_S) as server:
        yield Served(server.url, client_for(server.url), stats, app)
