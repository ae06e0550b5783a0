"""POST /v1/messages through the real `anthropic` client on the mlx-lm engine, checked against
mlx_lm.generate on the same conversation rendered by the model's own chat template."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

anthropic_sdk = pytest.importorskip("anthropic")

from serve.helpers import (  # noqa: E402
    MODEL_ID,
    TIMEOUT_S,
    GatedModel,
    Served,
    anthropic_client_for,
    cancelled_and_spent,
    post_json,
    scrape,
    together,
    wait_until,
)

Oracle = Callable[[list[int], int], str]
# The client no longer names sampling fields; the server takes them from the body.
GREEDY = {"temperature": 0}
SYSTEM = "you are a model of the arena"
TURNS = [
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the water is hot"},
    {
        "role": "user",
        "content": [{"type": "text", "text": "how are "}, {"type": "text", "text": "you"}],
    },
]
# The same conversation as a chat template reads it.
TEMPLATE_TURNS = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the water is hot"},
    {"role": "user", "content": "how are you"},
]


@pytest.fixture(scope="module")
def client(served: Served) -> Any:
    return anthropic_client_for(served.url)


def template_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    return [int(t) for t in tokenizer.apply_chat_template(messages, add_generation_prompt=True)]


def say(client: Any, content: str, max_tokens: int, **kw: Any) -> Any:
    return client.messages.create(
        model=MODEL_ID,
        max_tokens=max_tokens,
        messages=[{"role": "user", "content": content}],
        extra_body=GREEDY,
        **kw,
    )


def streamed_text(client: Any, content: str, max_tokens: int, **kw: Any) -> tuple[str, Any]:
    with client.messages.stream(
        model=MODEL_ID,
        max_tokens=max_tokens,
        messages=[{"role": "user", "content": content}],
        extra_body=GREEDY,
        **kw,
    ) as stream:
        text = "".join(stream.text_stream)
        return text, stream.get_final_message()


def test_system_and_turns_match_mlx_lm_greedy(client: Any, tokenizer: Any, oracle: Oracle) -> None:
    ids = template_ids(tokenizer, TEMPLATE_TURNS)
    want = oracle(ids, 20)
    assert len(want.split()) > 5
    m = client.messages.create(
        model=MODEL_ID, max_tokens=20, system=SYSTEM, messages=TURNS, extra_body=GREEDY
    )
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL_ID
    assert m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.input_tokens == len(ids) and m.usage.output_tokens == 20
    # The system prompt as text blocks is the same prompt.
    blocks = [{"type": "text", "text": SYSTEM}]
    again = client.messages.create(
        model=MODEL_ID, max_tokens=20, system=blocks, messages=TURNS, extra_body=GREEDY
    )
    assert again.content[0].text == want


def test_streamed_equals_whole_and_events_are_in_order(client: Any, served: Served) -> None:
    whole = say(client, "the water is hot", 20)
    text, final = streamed_text(client, "the water is hot", 20)
    assert text == whole.content[0].text
    assert [b.type for b in final.content] == ["text"]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 20
    # The raw events, as the API defines their order.
    body = {
        "model": MODEL_ID,
        "max_tokens": 8,
        "stream": True,
        "temperature": 0,
        "messages": [{"role": "user", "content": "hello world"}],
    }
    req = urllib.request.Request(
        served.url + "/v1/messages", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = []
    for frame in raw.strip().split("\n\n"):
        name_line, data_line = frame.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        events.append((name, data))
    names = [n for n, _ in events]
    deltas = names.count("content_block_delta")
    assert deltas > 1
    assert names == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["usage"]["output_tokens"] == 0 and start["content"] == []
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == 8


def test_stop_sequences_cut_both_modes_alike(client: Any) -> None:
    whole = say(client, "hello world how are you", 24).content[0].text
    words = whole.split(" ")
    stop = " " + words[4]
    want = whole[: whole.index(stop)]
    m = say(client, "hello world how are you", 24, stop_sequences=[stop])
    assert m.content[0].text == want
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    text, final = streamed_text(client, "hello world how are you", 24, stop_sequences=[stop])
    assert text == want
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_sampling_fields_are_taken(client: Any) -> None:
    """temperature, top_p and top_k reach the sampler: top_k 1 is greedy whatever the
    temperature (the sampler keeps only the most likely token)."""
    greedy = say(client, "a model of the arena", 16).content[0].text
    m = client.messages.create(
        model=MODEL_ID,
        max_tokens=16,
        messages=[{"role": "user", "content": "a model of the arena"}],
        extra_body={"temperature": 1.0, "top_k": 1, "top_p": 0.9},
    )
    assert m.content[0].text == greedy


def test_concurrent_clients_get_their_lone_answers(client: Any, served: Served) -> None:
    """Messages clients, streamed and not, batched with OpenAI chat clients: the same
    conversation renders the same prompt on both routes, so every one gets the lone answer."""
    prompts = ["hello world", "the water is hot", "a model of the arena", "you can write"]
    lone = {p: say(client, p, 24).content[0].text for p in prompts}
    assert len(set(lone.values())) > 1

    def ask(p: str, i: int) -> str:
        if i % 3 == 0:
            return say(client, p, 24).content[0].text
        if i % 3 == 1:
            return streamed_text(client, p, 24)[0]
        chunks = served.client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": p}],
            max_tokens=24,
            temperature=0,
            stream=True,
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    # Eight at once: the fixture's queue holds eight, so none is refused however they arrive.
    # Each kind of client meets each other kind (i % 3 against i % 4).
    got = together([lambda p=p, i=i: ask(p, i) for i, p in enumerate(prompts * 2)])
    assert got == [lone[p] for p in prompts * 2]


@pytest.mark.parametrize(
    ("body", "status", "kind", "names"),
    [
        ({"model": "other", "max_tokens": 4}, 404, "not_found_error", "other"),
        ({"model": MODEL_ID}, 400, "invalid_request_error", "max_tokens"),
        (
            {"model": MODEL_ID, "max_tokens": 4, "temperature": 1.5},
            400,
            "invalid_request_error",
            "temperature",
        ),
        (
            {
                "model": MODEL_ID,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            400,
            "invalid_request_error",
            "image",
        ),
        (
            {
                "model": MODEL_ID,
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}],
                    }
                ],
            },
            400,
            "invalid_request_error",
            "tool_use",
        ),
        (
            {
                "model": MODEL_ID,
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "x",
                                "content": [{"type": "image", "source": {}}],
                            }
                        ],
                    }
                ],
            },
            400,
            "invalid_request_error",
            "tool result",
        ),
        (
            {"model": MODEL_ID, "max_tokens": 4, "top_k": 10**6},
            400,
            "invalid_request_error",
            "top_k",
        ),
        ({"model": MODEL_ID, "max_tokens": 10**6}, 400, "invalid_request_error", "context"),
    ],
)
def test_errors_in_the_messages_shape(
    served: Served, body: dict[str, Any], status: int, kind: str, names: str
) -> None:
    body = {"messages": [{"role": "user", "content": "hello"}], **body}
    code, err = post_json(served.url + "/v1/messages", json.dumps(body).encode())
    assert code == status
    assert set(err) == {"type", "error"} and err["type"] == "error"
    assert err["error"]["type"] == kind and names in err["error"]["message"]


def test_client_raises_its_own_error_types(client: Any) -> None:
    with pytest.raises(anthropic_sdk.NotFoundError):
        client.messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(anthropic_sdk.BadRequestError):
        client.messages.create(model=MODEL_ID, max_tokens=4, messages=[])


def test_malformed_json_is_an_anthropic_error(served: Served) -> None:
    code, err = post_json(served.url + "/v1/messages", b"{not json")
    assert code == 400 and err["error"]["type"] == "invalid_request_error"
    # The OpenAI routes keep their own shape.
    code, err = post_json(served.url + "/v1/chat/completions", b"{not json")
    assert code == 400 and err["error"]["code"] == "invalid_json"


def test_count_tokens(client: Any, tokenizer: Any) -> None:
    n = client.messages.count_tokens(model=MODEL_ID, system=SYSTEM, messages=TURNS)
    assert n.input_tokens == len(template_ids(tokenizer, TEMPLATE_TURNS))


def test_disconnect_mid_stream_stops_the_generation(client: Any, served: Served) -> None:
    """A streamed client that goes away cancels its job (the batch does not run it to its
    budget), and the next request gets its usual answer."""
    lone = say(client, "hello world", 16).content[0].text
    before = scrape(served.url)
    max_tokens = 6000
    stream = client.messages.create(
        model=MODEL_ID,
        max_tokens=max_tokens,
        messages=[{"role": "user", "content": "hello world"}],
        extra_body=GREEDY,
        stream=True,
    )
    deltas = 0
    for event in stream:
        deltas += event.type == "content_block_delta"
        if deltas == 3:
            break
    stream.close()  # drops the connection with the generation still running
    spent = cancelled_and_spent(served.url, before)
    assert 3 <= spent < max_tokens
    assert say(client, "hello world", 16).content[0].text == lone


def test_full_queue_is_overloaded_529(gated: tuple[GatedModel, str]) -> None:
    g, url = gated
    c = anthropic_client_for(url)
    results: dict[str, Any] = {}

    def call(name: str) -> None:
        try:
            results[name] = say(c, "hello world", 4).content[0].text
        except BaseException as e:
            results[name] = e

    threads = [threading.Thread(target=call, args=("running",))]
    threads[0].start()
    assert g.entered.wait(TIMEOUT_S)  # the worker is inside the model, held by the gate
    threads.append(threading.Thread(target=call, args=("waiting",)))
    threads[1].start()
    wait_until(lambda: scrape(url)["strata_serve_queue_depth"] == 1, "the second to queue")
    with pytest.raises(anthropic_sdk.APIStatusError) as e:  # answered now, not left waiting
        say(c, "hello world", 4)
    assert e.value.status_code == 529
    assert e.value.body["error"]["type"] == "overloaded_error"
    g.gate.set()
    for t in threads:
        t.join(TIMEOUT_S)
    assert isinstance(results["running"], str) and results["waiting"] == results["running"]
