"""POST /v1/messages and tool calls on the transformers engine (`serve --engine transformers`),
through the real `anthropic` and `openai` clients.

The served model streams its experts at a quarter of them (strata_stream.transformers.load);
the oracle is plain transformers on the same float32 checkpoint (greedy `generate`), on the
conversation as the tokenizer's own template renders it: Qwen3's, with tools
(tests/data/qwen3_chat_template.jinja), over a WordLevel tokenizer that has the tool tokens
(tool_model.py). The tool call itself is forced (tool_model.force_torch) and comes back as each
API's call, streamed and whole alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("anthropic")

from serve.harness import Clients, hf_tokenizer, quarter_streamed, serving  # noqa: E402
from serve.helpers import together  # noqa: E402
from serve.tool_model import (  # noqa: E402
    ANTHROPIC_TOOL,
    CALL_ARGS,
    CALL_NAME,
    WEATHER_TOOL,
    chain,
    force_torch,
    hf_messages_round_trip,
)
from strata_stream.serve import ServeConfig  # noqa: E402
from strata_stream.serve.tool_calls import tool_syntax  # noqa: E402
from strata_stream.transformers import stats_source  # noqa: E402

if TYPE_CHECKING:
    from test_transformers_families import Family

MODEL_ID = "tiny-hf-qwen3-moe"
GREEDY = {"temperature": 0}
EOS = 1


@pytest.fixture(scope="module")
def fam(hf_tool_family: Family) -> Family:
    return hf_tool_family


@pytest.fixture(scope="module")
def tokenizer(fam: Family) -> Any:
    return hf_tokenizer(fam)


@pytest.fixture(scope="module")
def server(fam: Family, tokenizer: Any) -> Iterator[Clients]:
    model = quarter_streamed(fam)
    forced = force_torch(model, chain(tokenizer, EOS))
    config = ServeConfig(model_id=MODEL_ID)
    with serving(model, tokenizer, config, stats=stats_source(model), close_engine=True) as s:
        yield Clients(s.url, forced)


def greedy_text(
    fam: Family,
    tokenizer: Any,
    messages: list[dict[str, Any]],
    n: int,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Plain transformers' greedy reply (to its EOS or n tokens) to the rendered conversation."""
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    ids = torch.tensor([tokenizer.encode(text)])
    with torch.no_grad():
        # The mask is given: generate would otherwise take the prompt's <unk> tokens (id 0,
        # the generation config's pad id) for padding and mask them out.
        out = fam.ref.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
        )
    new = [int(t) for t in out[0, ids.shape[1] :]]
    new = new[: new.index(EOS)] if EOS in new else new
    return str(tokenizer.decode(new))


def say(s: Clients, text: str, n: int, **kw: Any) -> Any:
    return s.anthropic.messages.create(
        model=MODEL_ID,
        max_tokens=n,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": text}],
        **kw,
    )


def test_messages_are_plain_transformers_greedy_text(
    fam: Family, tokenizer: Any, server: Clients
) -> None:
    msgs = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 w9 w11"}]
    want = greedy_text(fam, tokenizer, msgs, 12)
    assert len(want.split()) > 5
    m = server.anthropic.messages.create(
        model=MODEL_ID,
        max_tokens=12,
        system="w1 w2",
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "w3 w9 w11"}],
    )
    assert m.content[0].text == want
    with server.anthropic.messages.stream(
        model=MODEL_ID,
        max_tokens=12,
        system="w1 w2",
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "w3 w9 w11"}],
    ) as stream:
        assert "".join(stream.text_stream) == want
        final = stream.get_final_message()
    assert final.stop_reason == m.stop_reason and final.usage == m.usage


def test_concurrent_clients_get_their_lone_answers(server: Clients) -> None:
    prompts = ["w44 w13", "w30 w31 w7", "w9 w9 w2 w3", "w5 w6"]
    lone = {p: say(server, p, 10).content[0].text for p in prompts}
    assert len(set(lone.values())) > 1

    def ask(p: str, i: int) -> Any:
        if i % 2:
            with server.anthropic.messages.stream(
                model=MODEL_ID,
                max_tokens=10,
                extra_body=GREEDY,
                messages=[{"role": "user", "content": p}],
            ) as stream:
                return "".join(stream.text_stream)
        return say(server, p, 10).content[0].text

    got = together([lambda p=p, i=i: ask(p, i) for i, p in enumerate(prompts * 2)])
    assert got == [lone[p] for p in prompts * 2]


def test_tool_calls_whole_and_streamed(server: Clients, tokenizer: Any) -> None:
    """Parsed by transformers' own parser: the tokenizer declares a response_template."""
    syntax = tool_syntax(tokenizer)
    assert syntax is not None and syntax.source == "transformers response_template"
    msgs = [{"role": "user", "content": "w3 w9"}]
    with server.forced.armed():
        r = server.openai.chat.completions.create(
            model=MODEL_ID, messages=msgs, tools=[WEATHER_TOOL], max_tokens=16, temperature=0
        )
        chunks = list(
            server.openai.chat.completions.create(
                model=MODEL_ID,
                messages=msgs,
                tools=[WEATHER_TOOL],
                max_tokens=16,
                temperature=0,
                stream=True,
            )
        )
        m = server.anthropic.messages.create(
            model=MODEL_ID, max_tokens=16, extra_body=GREEDY, tools=[ANTHROPIC_TOOL], messages=msgs
        )
        with server.anthropic.messages.stream(
            model=MODEL_ID, max_tokens=16, extra_body=GREEDY, tools=[ANTHROPIC_TOOL], messages=msgs
        ) as stream:
            final = stream.get_final_message()
    (call,) = r.choices[0].message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == (CALL_NAME, CALL_ARGS)
    assert r.choices[0].finish_reason == "tool_calls"
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function and deltas[0].function.name == CALL_NAME
    args = "".join(d.function.arguments or "" for d in deltas if d.function)
    assert json.loads(args) == CALL_ARGS
    for msg in (m, final):
        assert [(b.type, b.name, b.input) for b in msg.content] == [
            ("tool_use", CALL_NAME, CALL_ARGS)
        ]
        assert msg.stop_reason == "tool_use"


def test_tool_result_round_trip(fam: Family, tokenizer: Any, server: Clients) -> None:
    want = greedy_text(
        fam,
        tokenizer,
        hf_messages_round_trip("w3 w9", "toolu_1", "w20 w21"),
        12,
        tools=[WEATHER_TOOL],
    )
    assert len(want.split()) > 3
    m = server.anthropic.messages.create(
        model=MODEL_ID,
        max_tokens=12,
        extra_body=GREEDY,
        tools=[ANTHROPIC_TOOL],
        messages=[
            {"role": "user", "content": "w3 w9"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": CALL_NAME, "input": CALL_ARGS}
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "w20 w21"}
                ],
            },
        ],
    )
    assert m.content[0].text == want
