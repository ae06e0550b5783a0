"""One worker, a bounded queue: overflow is answered 503 at once; a client that goes away
mid-stream stops its generation, and the next request is served normally."""

from __future__ import annotations

import threading
from typing import Any

import openai
import pytest

from serve.helpers import (
    MODEL_ID,
    TIMEOUT_S,
    GatedModel,
    Served,
    cancelled_and_spent,
    client_for,
    scrape,
    wait_until,
)

MSG = [{"role": "user", "content": "hello world"}]


def test_disconnect_mid_stream_stops_the_generation(served: Served) -> None:
    lone = (
        served.client.chat.completions.create(
            model=MODEL_ID, messages=MSG, max_tokens=16, temperature=0
        )
        .choices[0]
        .message.content
    )
    before = scrape(served.url)
    max_tokens = 6000
    stream = served.client.chat.completions.create(
        model=MODEL_ID, messages=MSG, max_tokens=max_tokens, temperature=0, stream=True
    )
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got == 3:
            break
    stream.close()  # drops the connection with the generation still running

    spent = cancelled_and_spent(served.url, before)
    assert 3 <= spent < max_tokens  # stopped early, not run to its budget
    again = (
        served.client.chat.completions.create(
            model=MODEL_ID, messages=MSG, max_tokens=16, temperature=0
        )
        .choices[0]
        .message.content
    )
    assert again == lone


def test_queue_overflow_is_answered_503_at_once(gated: tuple[GatedModel, str]) -> None:
    g, url = gated
    client = client_for(url)
    results: dict[str, Any] = {}

    def call(name: str) -> None:
        try:
            r = client.chat.completions.create(
                model=MODEL_ID, messages=MSG, max_tokens=4, temperature=0
            )
            results[name] = r.choices[0].message.content
        except BaseException as e:
            results[name] = e

    running = threading.Thread(target=call, args=("running",))
    running.start()
    assert g.entered.wait(TIMEOUT_S)  # the worker is inside the model, held by the gate
    waiting = threading.Thread(target=call, args=("waiting",))
    waiting.start()
    wait_until(lambda: scrape(url)["strata_serve_queue_depth"] == 1, "the second request to queue")

    with pytest.raises(openai.APIStatusError) as e:  # the gate is still closed: not left hanging
        client.chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=4)
    assert e.value.status_code == 503
    assert e.value.code == "queue_full"

    g.gate.set()
    running.join(TIMEOUT_S)
    waiting.join(TIMEOUT_S)
    assert isinstance(results["running"], str) and results["running"]
    assert results["waiting"] == results["running"]
    m = scrape(url)
    assert m['strata_serve_requests_total{route="/v1/chat/completions",status="503"}'] == 1
    assert m['strata_serve_requests_total{route="/v1/chat/completions",status="200"}'] == 2
