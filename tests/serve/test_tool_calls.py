"""Tool calls on the mlx-lm engine through the real `openai` and `anthropic` clients: the
tools go into Qwen3's chat template, the call the model writes (forced, tool_model.py) comes
back as the API's tool call, streamed and whole alike, and the tool's result goes back through
the template to a reply that is plain mlx-lm's on the same conversation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("anthropic")

import mlx_lm  # noqa: E402

from serve.harness import Clients, serving  # noqa: E402
from serve.helpers import MODEL_ID, post_json  # noqa: E402
from serve.tool_model import (  # noqa: E402
    ANTHROPIC_TOOL,
    CALL_ARGS,
    CALL_NAME,
    WEATHER_TOOL,
    ForcedReply,
    chain,
    hf_messages_round_trip,
    make_tool_checkpoint,
)

# The anthropic client sends sampling fields the current API no longer names in its body.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def tool_path(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tool_checkpoint(tiny_path, tmp_path_factory.mktemp("tools") / "model")


@pytest.fixture(scope="module")
def tool_server(tool_path: Path) -> Iterator[Clients]:
    model, tokenizer = mlx_lm.load(str(tool_path))
    forced = ForcedReply(model, chain(tokenizer, tokenizer.eos_token_id))
    with serving(forced, tokenizer, engine="mlx-lm") as server:
        yield Clients(server.url, forced)


@pytest.fixture(scope="module")
def tool_oracle(tool_path: Path) -> Any:
    """Greedy text of plain mlx-lm on its own copy of the model, for a conversation rendered
    by the tokenizer's own template with the tools."""
    model, tokenizer = mlx_lm.load(str(tool_path))

    def generate(messages: list[dict[str, Any]], max_tokens: int) -> str:
        ids = tokenizer.apply_chat_template(
            messages, tools=[WEATHER_TOOL], add_generation_prompt=True
        )
        return str(mlx_lm.generate(model, tokenizer, ids, max_tokens=max_tokens))

    return generate


def openai_call(s: Clients, stream: bool) -> tuple[str | None, list[Any], str | None]:
    """(content, tool calls as (name, arguments JSON), finish_reason) of one forced turn."""
    kw: dict[str, Any] = dict(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "the water is hot"}],
        tools=[WEATHER_TOOL],
        max_tokens=24,
        temperature=0,
    )
    with s.forced.armed():
        if not stream:
            r = s.openai.chat.completions.create(**kw)
            calls = r.choices[0].message.tool_calls or []
            got = [(c.function.name, c.function.arguments, c.id) for c in calls]
            return r.choices[0].message.content, got, r.choices[0].finish_reason
        chunks = list(s.openai.chat.completions.create(stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    parts: dict[int, list[str]] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = parts.setdefault(d.index, ["", "", ""])
            if d.id:
                entry[2] = d.id
            if d.function and d.function.name:
                entry[0] = d.function.name
            if d.function and d.function.arguments:
                entry[1] += d.function.arguments
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    return text or None, [tuple(parts[i]) for i in sorted(parts)], finals[-1]


def test_openai_tool_call_whole_and_streamed(tool_server: Clients) -> None:
    for stream in (False, True):
        content, calls, finish = openai_call(tool_server, stream)
        assert content is None, stream
        assert [(n, json.loads(a)) for n, a, _ in calls] == [(CALL_NAME, CALL_ARGS)], stream
        assert calls[0][2].startswith("call_")
        assert finish == "tool_calls"


def test_without_forcing_the_reply_is_text(tool_server: Clients) -> None:
    """The same request unforced: the random model writes words, which come back as text."""
    r = tool_server.openai.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": "the water is hot"}],
        tools=[WEATHER_TOOL],
        max_tokens=12,
        temperature=0,
    )
    assert r.choices[0].message.tool_calls is None
    assert len((r.choices[0].message.content or "").split()) > 3
    assert r.choices[0].finish_reason == "length"


def test_anthropic_tool_use_whole_and_streamed(tool_server: Clients) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL_ID,
        max_tokens=24,
        extra_body=GREEDY,
        tools=[ANTHROPIC_TOOL],
        messages=[{"role": "user", "content": "the water is hot"}],
    )
    with tool_server.forced.armed():
        whole = tool_server.anthropic.messages.create(**kw)
    assert [b.type for b in whole.content] == ["tool_use"]
    block = whole.content[0]
    assert block.name == CALL_NAME and block.input == CALL_ARGS and block.id.startswith("toolu_")
    assert whole.stop_reason == "tool_use"
    with tool_server.forced.armed(), tool_server.anthropic.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", CALL_NAME, CALL_ARGS)
    ]
    assert final.stop_reason == "tool_use"
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds


def test_tool_result_goes_back_through_the_template(tool_server: Clients, tool_oracle: Any) -> None:
    """Both APIs send the call and its result back; the reply is plain mlx-lm's greedy text on
    the same conversation as the template renders it with the tools."""
    want = tool_oracle(hf_messages_round_trip("the water is hot", "call_1", "w3 hot"), 16)
    assert len(want.split()) > 5
    r = tool_server.openai.chat.completions.create(
        model=MODEL_ID,
        tools=[WEATHER_TOOL],
        max_tokens=16,
        temperature=0,
        messages=[
            {"role": "user", "content": "the water is hot"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": CALL_NAME, "arguments": json.dumps(CALL_ARGS)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "w3 hot"},
        ],
    )
    assert r.choices[0].message.content == want
    assert r.choices[0].message.tool_calls is None
    m = tool_server.anthropic.messages.create(
        model=MODEL_ID,
        max_tokens=16,
        extra_body=GREEDY,
        tools=[ANTHROPIC_TOOL],
        messages=[
            {"role": "user", "content": "the water is hot"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "call_1", "name": CALL_NAME, "input": CALL_ARGS}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "w3 hot"}],
            },
        ],
    )
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text == want
    assert m.stop_reason == "max_tokens"


def test_tools_refused_where_the_template_has_no_tool_format(served: Any) -> None:
    """The plain chat checkpoint's template knows no tools: a request with tools is a 400
    naming them, in each API's error shape."""
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "hello"}],
        "tools": [WEATHER_TOOL],
        "max_tokens": 4,
    }
    status, err = post_json(served.url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and err["error"]["param"] == "tools"
    body["tools"] = [ANTHROPIC_TOOL]
    status, err = post_json(served.url + "/v1/messages", json.dumps(body).encode())
    assert status == 400 and err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error" and "tool" in err["error"]["message"]
