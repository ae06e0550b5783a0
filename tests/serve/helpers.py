"""Helpers shared by the serve tests: the fake stats source, clients, /metrics scraping."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import openai
from prometheus_client.parser import text_string_to_metric_families

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


def client_for(url: str, **kw: Any) -> openai.OpenAI:
    # max_retries=0: a 503 must reach the test, not be retried away.
    return openai.OpenAI(
        base_url=url + "/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0, **kw
    )


def scrape(url: str) -> dict[str, float]:
    """/metrics parsed by prometheus_client's own parser: sample name{labels} -> value."""
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


class GatedModel:
    """The real model behind a gate the test opens: holds the worker inside a forward pass
    so the queue can be filled deterministically."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        if not self.gate.wait(TIMEOUT_S):
            raise TimeoutError("the test never opened the gate")
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def post_json(url: str, body: bytes, timeout: float = TIMEOUT_S) -> tuple[int, dict[str, Any]]:
    """POSTs raw bytes as JSON; (status, the answer's JSON), errors included."""
    import json
    import urllib.error

    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health(url: str) -> tuple[int, dict[str, Any]]:
    """/health's status code and body (503 included: the body says why)."""
    import json
    import urllib.error

    try:
        with urllib.request.urlopen(url + "/health", timeout=TIMEOUT_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
