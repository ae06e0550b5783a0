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
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
anthropic_sdk = pytest.importorskip("anthropic")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: the families module
from serve.helpers import TIMEOUT_S, client_for  # noqa: E402
from serve.tool_model import (  # noqa: E402
    CALL_ARGS,
    CALL_NAME,
    RESPONSE_TEMPLATE,
    WEATHER_TOOL,
    ForcedReply,
    chain,
    force_torch,
    hf_messages_round_trip,
    save_word_tool_tokenizer,
)
from strata_stream.serve import BackgroundServer, ServeConfig, create_app  # noqa: E402
from strata_stream.serve.tool_calls import tool_syntax  # noqa: E402
from strata_stream.transformers import stats_source  # noqa: E402
from test_transformers_families import Family  # noqa: E402

MODEL_ID = "tiny-hf-qwen3-moe"
GREEDY = {"temperature": 0}
ANTHROPIC_TOOL = {
    "name": CALL_NAME,
    "description": WEATHER_TOOL["function"]["description"],
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
EOS = 1


@pytest.fixture(scope="module")
def fam(tmp_path_factory: pytest.TempPathFactory) -> Family:
    f = Family("qwen3_moe", tmp_path_factory.mktemp("serve_hf_tools"), "float32")
    save_word_tool_tokenizer(f.path, response_template=RESPONSE_TEMPLATE)
    return f


@pytest.fixture(scope="module")
def tokenizer(fam: Family) -> Any:
    return transformers.AutoTokenizer.from_pretrained(fam.path)


class HFServer:
    def __init__(self, url: str, forced: ForcedReply) -> None:
        self.url = url
        self.forced = forced
        self.openai = client_for(url)
        self.anthropic = anthropic_sdk.Anthropic(
            base_url=url, api_key="unused", timeout=TIMEOUT_S, max_retries=0
        )


@pytest.fixture(scope="module")
def server(fam: Family, tokenizer: Any) -> Iterator[HFServer]:
    model = fam.load(slots=fam.n_records // 4)
    forced = force_torch(model, chain(tokenizer, EOS))
    try:
        app = create_app(
            model, tokenizer, ServeConfig(model_id=MODEL_ID), stats=stats_source(model)
        )
        with BackgroundServer(app, timeout_s=TIMEOUT_S) as s:
            yield HFServer(s.url, forced)
    finally:
        model.strata_engine.close()


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


def say(s: HFServer, text: str, n: int, **kw: Any) -> Any:
    return s.anthropic.messages.create(
        model=MODEL_ID,
        max_tokens=n,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": text}],
        **kw,
    )


def test_messages_are_plain_transformers_greedy_text(
    fam: Family, tokenizer: Any, server: HFServer
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


def test_concurrent_clients_get_their_lone_answers(server: HFServer) -> None:
    prompts = ["w44 w13", "w30 w31 w7", "w9 w9 w2 w3", "w5 w6"]
    lone = {p: say(server, p, 10).content[0].text for p in prompts}
    assert len(set(lone.values())) > 1
    got: dict[tuple[str, int], str] = {}
    errors: list[BaseException] = []

    def run(p: str, i: int) -> None:
        try:
            if i % 2:
                with server.anthropic.messages.stream(
                    model=MODEL_ID,
                    max_tokens=10,
                    extra_body=GREEDY,
                    messages=[{"role": "user", "content": p}],
                ) as stream:
                    got[p, i] = "".join(stream.text_stream)
            else:
                got[p, i] = say(server, p, 10).content[0].text
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p, i)) for i, p in enumerate(prompts * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(got) == 8
    for (p, _), text in got.items():
        assert text == lone[p]


def test_tool_calls_whole_and_streamed(server: HFServer, tokenizer: Any) -> None:
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


def test_tool_result_round_trip(fam: Family, tokenizer: Any, server: HFServer) -> None:
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
