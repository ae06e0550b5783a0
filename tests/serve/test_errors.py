"""Bad input gets OpenAI-style error JSON with the right status, and the server keeps serving."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from serve.helpers import MODEL_ID, Served, post_json


def assert_openai_error(body: dict[str, Any], param: str | None, code: str | None) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param and err["code"] == code


MSG = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (b"{not json", 400, None, "invalid_json"),
        (b"[1, 2]", 400, None, "invalid_json"),
        (json.dumps({"model": MODEL_ID}).encode(), 400, "messages", "missing"),
        (json.dumps({"messages": MSG}).encode(), 400, "model", "missing"),
        (
            json.dumps({"model": MODEL_ID, "messages": []}).encode(),
            400,
            "messages",
            "invalid_value",
        ),
        (
            json.dumps({"model": MODEL_ID, "messages": [{"role": "x", "content": "y"}]}).encode(),
            400,
            "messages.0.role",
            "invalid_value",
        ),
        (
            json.dumps({"model": MODEL_ID, "messages": MSG, "temperature": 9}).encode(),
            400,
            "temperature",
            "invalid_value",
        ),
        (
            json.dumps({"model": MODEL_ID, "messages": MSG, "n": 2}).encode(),
            400,
            "n",
            "invalid_value",
        ),
        (
            json.dumps({"model": MODEL_ID, "messages": MSG, "max_tokens": 0}).encode(),
            400,
            "max_tokens",
            "invalid_value",
        ),
        (
            json.dumps({"model": "no-such-model", "messages": MSG}).encode(),
            404,
            "model",
            "model_not_found",
        ),
    ],
)
def test_bad_chat_requests(
    served: Served, body: bytes, status: int, param: str | None, code: str | None
) -> None:
    got, answer = post_json(served.url + "/v1/chat/completions", body)
    assert got == status
    assert_openai_error(answer, param, code)


def test_bad_completion_requests(served: Served) -> None:
    url = served.url + "/v1/completions"
    got, answer = post_json(url, json.dumps({"model": MODEL_ID}).encode())
    assert got == 400 and answer["error"]["param"] == "prompt"
    got, answer = post_json(url, json.dumps({"model": MODEL_ID, "prompt": [5, 10**6]}).encode())
    assert got == 400 and "outside the vocabulary" in answer["error"]["message"]
    got, answer = post_json(url, json.dumps({"model": MODEL_ID, "prompt": ""}).encode())
    assert got == 400 and answer["error"]["param"] == "prompt"


def test_prompt_beyond_the_context_is_a_400(served: Served) -> None:
    long = "the " * 9000  # the tiny model's context is 8192 tokens
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": long}]
        )
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        served.client.completions.create(model=MODEL_ID, prompt="the water", max_tokens=9000)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_tokens"


def test_unknown_model_and_route_are_404(served: Served) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        served.client.chat.completions.create(
            model="gpt-5", messages=[{"role": "user", "content": "x"}]
        )
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        served.client.models.retrieve("gpt-5")
    got, answer = post_json(served.url + "/v1/nothing-here", b"{}")
    assert got == 404
    assert_openai_error(answer, None, "not_found")


def test_server_keeps_serving_after_errors(served: Served) -> None:
    for _ in range(3):
        post_json(served.url + "/v1/chat/completions", b"{broken")
    r = served.client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0
    )
    assert r.choices[0].finish_reason == "length" and r.usage is not None
    assert r.usage.completion_tokens == 4


def test_oversized_body_is_a_413_before_it_is_read(served: Served) -> None:
    import http.client
    import urllib.parse

    from strata_stream.serve.app import MAX_BODY_BYTES

    u = urllib.parse.urlsplit(served.url)
    conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(MAX_BODY_BYTES + 1))
        conn.endheaders()  # the body never comes: the server must answer without waiting for it
        r = conn.getresponse()
        assert r.status == 413
        assert_openai_error(json.loads(r.read()), None, "request_too_large")
    finally:
        conn.close()
