"""serve/tool_calls.py and the Messages API's event framing, without a server: which parser a
template gets, that any split of the streamed text gives the same calls and text as the whole,
that what does not parse stays text, and the content-block events of a streamed answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from types import SimpleNamespace
from typing import Any

import pytest

from serve.tool_model import QWEN3_TEMPLATE, RESPONSE_TEMPLATE
from strata_stream.serve.anthropic import MessagesRequest, message_events
from strata_stream.serve.errors import APIError
from strata_stream.serve.jobs import Finished
from strata_stream.serve.requests import ChatCompletionRequest
from strata_stream.serve.tool_calls import (
    Piece,
    TemplateSplitter,
    ToolCall,
    ToolCallSplitter,
    ToolSyntax,
    merge_pieces,
    split_all,
    tool_syntax,
)


def hf_like(template: str, vocab: dict[str, int] | None = None) -> Any:
    """What the parser inference reads of a transformers tokenizer."""
    return SimpleNamespace(chat_template=template, get_vocab=lambda: dict(vocab or {}))


def qwen3() -> ToolSyntax:
    syntax = tool_syntax(hf_like(QWEN3_TEMPLATE))
    assert syntax is not None
    return syntax


def shape(pieces: list[Piece]) -> list[Any]:
    """Pieces without the calls' random ids."""
    return [p if isinstance(p, str) else (p.name, json.loads(p.arguments)) for p in pieces]


def test_qwen3_template_gets_mlx_lm_parser() -> None:
    pytest.importorskip("mlx_lm")
    s = qwen3()
    assert s.source == "mlx-lm json_tools"
    assert (s.start, s.end) == ("<tool_call>", "</tool_call>")


def test_no_parser_for_a_template_without_tools() -> None:
    assert tool_syntax(hf_like("{% for m in messages %}{{ m['content'] }}{% endfor %}")) is None


TEXT = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n'
    "</tool_call>\nDone <tool"
)
WANT = [
    "Let me look.",
    ("get_weather", {"city": "Paris"}),
    ("get_time", {"zone": "CET"}),
    "Done <tool",
]


def test_whole_text_splits_into_text_and_calls() -> None:
    assert shape(split_all(qwen3(), None, TEXT)) == WANT


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 64])
def test_any_chunking_gives_the_whole_answer(size: int) -> None:
    s = ToolCallSplitter(qwen3(), None)
    pieces: list[Piece] = []
    for i in range(0, len(TEXT), size):
        pieces += s.feed(TEXT[i : i + size])
    pieces += s.finish()
    merged: list[Piece] = []
    for p in pieces:  # text may come in several pieces; joined it is the same text
        if isinstance(p, str) and merged and isinstance(merged[-1], str):
            merged[-1] += p
        else:
            merged.append(p)
    assert shape(merged) == WANT
    assert s.calls == 2


def test_text_that_may_start_a_marker_is_held_back() -> None:
    s = ToolCallSplitter(qwen3(), None)
    assert s.feed("hello <tool_") == ["hello"]
    assert s.feed("x") == [" <tool_x"]  # not a marker after all


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "f", "arguments": {"a": </tool_call>',  # malformed JSON
        '<tool_call>\n{"name": "f", "argum',  # cut off by max_tokens
        "<tool_call>\n[1, 2]\n</tool_call>",  # JSON, but not a call
    ],
)
def test_what_does_not_parse_is_text(text: str) -> None:
    assert split_all(qwen3(), None, text) == [text]


def test_ids_are_the_api_s() -> None:
    (call,) = split_all(qwen3(), None, '<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert isinstance(call, ToolCall) and call.id.startswith("call_") and call.input == {}
    s = ToolCallSplitter(qwen3(), None, id_prefix="toolu_")
    (call,) = s.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>') + s.finish()
    assert isinstance(call, ToolCall) and call.id.startswith("toolu_")


def test_deepseek_calls() -> None:
    template = "{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' }}"
    syntax = tool_syntax(hf_like(template))
    assert syntax is not None and syntax.source == "strata-stream"
    text = (
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function'
        '<｜tool▁sep｜>get_time\n```json\n{"zone": "CET"}\n```<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>"
    )
    assert shape(split_all(syntax, None, text)) == [
        "Checking.",
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]


def test_harmony_calls() -> None:
    syntax = tool_syntax(hf_like("{{ 'to=functions.' + name + '<|call|>' }}"))
    assert syntax is not None and syntax.source == "strata-stream"
    text = (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city": "Paris"}<|call|>'
    )
    assert shape(split_all(syntax, None, text)) == [
        "<|channel|>commentary",
        ("get_weather", {"city": "Paris"}),
    ]


async def _events(pieces: list[Piece | Finished]) -> list[tuple[str, dict[str, Any]]]:
    async def source() -> AsyncGenerator[Piece | Finished, None]:
        for p in pieces:
            yield p

    def raise_for(end: Finished) -> None:
        raise AssertionError("no error here")

    out = []
    async for frame in message_events(source(), "msg_1", "m", 7, raise_for):
        name, data = frame.decode().strip().split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_messages_stream_framing_of_text_and_tool_use() -> None:
    call = ToolCall("toolu_1", "get_weather", '{"city": "Paris"}')
    events = asyncio.run(_events(["Let ", "me look.", call, Finished("stop", 7, 12)]))
    names = [n for n, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [d.get("index") for n, d in events if n.startswith("content_block")] == [0] * 4 + [1] * 3
    assert events[5][1]["content_block"] == {
        "type": "tool_use",
        "id": "toolu_1",
        "name": "get_weather",
        "input": {},
    }
    assert events[6][1]["delta"] == {"type": "input_json_delta", "partial_json": call.arguments}
    assert events[8][1]["delta"]["stop_reason"] == "tool_use"
    assert events[8][1]["usage"] == {"output_tokens": 12}
    assert events[0][1]["message"]["usage"] == {"input_tokens": 7, "output_tokens": 0}


def test_messages_conversation_as_the_template_reads_it() -> None:
    req = MessagesRequest.model_validate({
        "model": "m",
        "max_tokens": 4,
        "system": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "42"}]},
                {"type": "text", "text": "thanks"},
            ]},
        ],
    })  # fmt: skip
    assert req.template_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "t1", "name": "f", "content": "42"},
        {"role": "user", "content": "thanks"},
    ]  # fmt: skip
    assert req.tool_specs() == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    ]
    none = MessagesRequest.model_validate({**req.model_dump(), "tool_choice": {"type": "none"}})
    assert none.tool_specs() is None


def test_chat_conversation_as_the_template_reads_it() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body: dict[str, Any] = {
        "model": "m",
        "tools": [tool],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": '{"a": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ],
    }  # fmt: skip
    req = ChatCompletionRequest.model_validate(body)
    req.check()
    assert req.template_messages()[1:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"},
    ]  # fmt: skip
    assert req.tool_specs() == [tool]
    assert (
        ChatCompletionRequest.model_validate({**body, "tool_choice": "none"}).tool_specs() is None
    )
    bad = ChatCompletionRequest.model_validate({**body, "tool_choice": {
        "type": "function", "function": {"name": "g"}}})  # fmt: skip
    with pytest.raises(APIError, match="no tool is named 'g'"):
        bad.check()
    body["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    with pytest.raises(APIError, match=r"messages\.1\.tool_calls\.0\.function\.arguments"):
        ChatCompletionRequest.model_validate(body).check()


def template_splitter() -> TemplateSplitter:
    pytest.importorskip("transformers.utils.chat_parsing.response_parser")
    return TemplateSplitter(RESPONSE_TEMPLATE, None, "call_", "w1 <|im_start|> assistant")


WORD_TEXT = (
    'w1 w2 <tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call> '
    '<tool_call> {"name": "get_time", "arguments": {}} </tool_call> w3 <|im_end|>'
)


@pytest.mark.parametrize("size", [1, 4, 9, 1000])
def test_response_template_splits_alike_in_any_chunking(size: int) -> None:
    s = template_splitter()
    pieces: list[Piece] = []
    for i in range(0, len(WORD_TEXT), size):
        pieces += s.feed(WORD_TEXT[i : i + size])
    pieces += s.finish()
    assert shape(merge_pieces(pieces)) == [
        "w1 w2",
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
        " w3",
    ]
    assert s.calls == 2


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_response_template_failure_is_the_text(size: int) -> None:
    text = (
        'w1 <tool_call> {"name": "f", "arguments": {}} </tool_call> w2 <tool_call> {"name": '
        "broken </tool_call> w3"
    )
    s = template_splitter()
    pieces: list[Piece] = []
    for i in range(0, len(text), size):
        pieces += s.feed(text[i : i + size])
    pieces += s.finish()
    assert shape(merge_pieces(pieces)) == [
        "w1",
        ("f", {}),
        ' w2 <tool_call> {"name": broken </tool_call> w3',
    ]
