"""The serve tests' fixtures: a tiny random-weight qwen3_moe checkpoint (and its pack), its
oracles, a server over it for the module, gated servers for a test, and the tiny transformers
checkpoint with the tool tokenizer (harness.py builds them)."""

from __future__ import annotations

import contextlib
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

from serve.harness import family, serving  # noqa: E402
from serve.helpers import MODEL_ID, FakeStats, GatedModel, Served, client_for  # noqa: E402
from serve.tool_model import RESPONSE_TEMPLATE, save_word_tool_tokenizer  # noqa: E402
from strata_stream.convert import convert  # noqa: E402
from strata_stream.mlx_lm.random_model import make_chat_checkpoint  # noqa: E402
from strata_stream.serve import ServeConfig  # noqa: E402


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def plain(tiny_path: Path) -> tuple[Any, Any]:
    """Plain mlx-lm's own copy of the model and its tokenizer, loaded once: the oracles' (never
    served: only a server's worker thread runs a served model). The tests' thread alone runs
    it."""
    model, tokenizer = mlx_lm.load(str(tiny_path))
    return model, tokenizer


@pytest.fixture(scope="session")
def oracle(plain: tuple[Any, Any]) -> Callable[[list[int], int], str]:
    """Greedy text from mlx_lm.generate on plain mlx-lm's copy of the model."""
    model, tokenizer = plain

    def generate(prompt: list[int], max_tokens: int) -> str:
        return str(mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens))

    return generate


@pytest.fixture(scope="session")
def reference(plain: tuple[Any, Any]) -> Callable[[list[int]], np.ndarray]:
    """reference(ids) -> [len(ids), vocab] log-softmax (float64) of plain mlx-lm's logits on
    its copy of the model, teacher-forced on ids: row t scores the token after ids[t]."""
    model, _ = plain

    def log_softmax(ids: list[int]) -> np.ndarray:
        logits = np.array(model(mx.array(ids)[None])[0].astype(mx.float32)).astype(np.float64)
        shifted = logits - logits.max(axis=-1, keepdims=True)
        out: np.ndarray = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
        return out

    return log_softmax


@pytest.fixture(scope="session")
def tokenizer(plain: tuple[Any, Any]) -> Any:
    return plain[1]


@pytest.fixture(scope="session")
def tiny_pack(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint's experts converted once, for the tests that only read the pack (a
    test that damages one converts its own)."""
    return convert(tiny_path, tmp_path_factory.mktemp("pack") / "experts.strpk", progress=False)


@pytest.fixture(scope="module")
def served(tiny_path: Path) -> Iterator[Served]:
    model, tokenizer = mlx_lm.load(str(tiny_path))
    stats = FakeStats()
    config = ServeConfig(model_id=MODEL_ID, max_queue=8, stats_interval_s=0.05)
    with serving(model, tokenizer, config, stats=stats) as server:
        yield Served(server.url, client_for(server.url), stats, server.app)


GatedServer = Callable[..., tuple[GatedModel, str]]


@pytest.fixture
def gated_server(tiny_path: Path) -> Iterator[GatedServer]:
    """gated_server(**ServeConfig fields) -> (gate, url): a server of this test over its own
    copy of the model behind a gate (helpers.GatedModel); every gate opens at the end, before
    its server shuts down."""
    with contextlib.ExitStack() as stack:

        def start(**cfg: Any) -> tuple[GatedModel, str]:
            model, tokenizer = mlx_lm.load(str(tiny_path))
            g = GatedModel(model)
            server = stack.enter_context(
                serving(g, tokenizer, ServeConfig(model_id=MODEL_ID, **cfg))
            )
            stack.callback(g.gate.set)
            return g, server.url

        yield start


@pytest.fixture
def gated(gated_server: GatedServer) -> tuple[GatedModel, str]:
    """A gated server whose queue holds one waiting request."""
    return gated_server(max_queue=1)


@pytest.fixture(scope="session")
def hf_tool_family(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny transformers checkpoint (harness.family) with the WordLevel tool tokenizer
    (tool_model.py), which declares Qwen3's chat template and a response_template."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    f = family(tmp_path_factory.mktemp("serve_hf_tools"))
    save_word_tool_tokenizer(f.path, response_template=RESPONSE_TEMPLATE)
    return f
