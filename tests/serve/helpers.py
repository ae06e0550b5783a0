"""Helpers shared by the serve tests: the fake stats source, clients, /metrics scraping, running
calls at once. harness.py stands up what these talk to."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
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


def anthropic_client_for(url: str) -> Any:
    """The `anthropic` client of the server at `url` (imported here: the tests that use it skip
    where it is not installed); max_retries=0: a 529 or 503 must reach the test."""
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key="unused", timeout=TIMEOUT_S, max_retries=0)


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


def counter(url: str, name: str) -> float:
    """A counter (its `_total` sample) or gauge of /metrics by name; -1 while it is not there."""
    samples = scrape(url)
    return samples.get(name + "_total", samples.get(name, -1.0))


def cancelled_and_spent(url: str, before: Mapping[str, float]) -> float:
    """Waits until the server counted one more cancelled generation than in `before` (a
    scrape) and its worker idles; the tokens generated since `before`."""
    cancelled = 'strata_serve_generations_total{reason="cancelled"}'
    wait_until(
        lambda: scrape(url).get(cancelled, 0.0) == before.get(cancelled, 0.0) + 1,
        "the server to cancel the disconnected generation",
    )
    wait_until(lambda: scrape(url)["strata_serve_worker_busy"] == 0, "the worker to idle")
    after = scrape(url)
    return (
        after["strata_serve_generated_tokens_total"] - before["strata_serve_generated_tokens_total"]
    )


def concurrently(calls: Sequence[Callable[[], Any]], timeout_s: float = 2 * TIMEOUT_S) -> list[Any]:
    """Each call on its own thread, all started at once; their results in order, an exception
    in the place of a call that raised."""
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as e:
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return out


def together(calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """concurrently(calls), none of which may raise."""
    out = concurrently(calls)
    errors = [r for r in out if isinstance(r, BaseException)]
    assert not errors, errors
    return out


def complete_scored(
    url: str, prompt: list[int], max_tokens: int, model: str = MODEL_ID
) -> tuple[str, Any, Any]:
    """One greedy completion of token ids as served: its text, the sampled tokens'
    log-probabilities and the top 3 at each."""
    import json

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logprobs": 3}  # fmt: skip
    status, answer = post_json(url + "/v1/completions", json.dumps(body).encode())
    assert status == 200, answer
    c = answer["choices"][0]
    return c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]


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
