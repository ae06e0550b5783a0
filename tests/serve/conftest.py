"""A tiny random-weight qwen3_moe checkpoint, served on a free loopback port for the module."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlx_lm")
pytest.importorskip("fastapi")
pytest.importorskip("openai")

import mlx_lm  # noqa: E402
import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from strata_stream.serve import BackgroundServer, ServeConfig, create_app  # noqa: E402
from strata_stream.serve.tiny_checkpoint import build_tiny_checkpoint  # noqa: E402

MODEL_ID = "tiny-qwen3-moe"
TIMEOUT_S = 60.0


class FakeStats:
    """A stats source whose counters the test sets; records which threads call it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, Any] = {}
        self.callers: set[str] = set()

    def set(self, **values: Any) -> None:
        with self._lock:
            self.values.update(values)

    def __call__(self) -> Mapping[str, Any]:
        with self._lock:
            self.callers.add(threading.current_thread().name)
            return dict(self.values)


@dataclass
class Served:
    url: str
    client: openai.OpenAI
    stats: FakeStats
    app: Any


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def oracle(tiny_path: Path) -> Callable[[list[int], int], str]:
    """Greedy text from mlx_lm.generate on its own copy of the model (never the served one,
    which only the server's worker thread may run)."""
    model, tokenizer = mlx_lm.load(str(tiny_path))

    def generate(prompt: list[int], max_tokens: int) -> str:
        return str(mlx_lm.generate(model, tokenizer, prompt, max_tokens=max_tokens))

    return generate


@pytest.fixture(scope="session")
def tokenizer(tiny_path: Path) -> Any:
    return mlx_lm.load(str(tiny_path))[1]


def client_for(url: str, **kw: Any) -> openai.OpenAI:
    # max_retries=0: a 503 must reach the test, not be retried away.
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0, **kw)


@pytest.fixture(scope="module")
def served(tiny_path: Path) -> Iterator[Served]:
    model, tokenizer = mlx_lm.load(str(tiny_path))
    stats = FakeStats()
    app = create_app(
        model, tokenizer, ServeConfig(model_id=MODEL_ID, max_queue=8, stats_interval_s=0.05),
        stats=stats,
    )
    with BackgroundServer(app, timeout_s=TIMEOUT_S) as server:
        yield Served(server.url, client_for(server.url), stats, app)


def scrape(url: str) -> dict[str, float]:
    """/metrics parsed by prometheus_client's own parser: sample name{labels} -> value."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=TIMEOUT_S) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)
