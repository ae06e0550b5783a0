"""The OpenAI routes through the real `openai` client, checked against mlx_lm.generate."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from serve.helpers import MODEL_ID, Served, together

Oracle = Callable[[list[int], int], str]


def chat_ids(tokenizer: Any, content: str) -> list[int]:
    msgs = [{"role": "user", "content": content}]
    return [int(t) for t in tokenizer.apply_chat_template(msgs, add_generation_prompt=True)]


def chat(served: Served, content: str, max_tokens: int, **kw: Any) -> Any:
    return served.client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        **kw,
    )


def test_models_lists_the_served_model(served: Served) -> None:
    assert [m.id for m in served.client.models.list()] == [MODEL_ID]
    assert served.client.models.retrieve(MODEL_ID).id == MODEL_ID


def test_chat_matches_mlx_lm_greedy(served: Served, tokenizer: Any, oracle: Oracle) -> None:
    r = chat(served, "hello world how are you", 24)
    want = oracle(chat_ids(tokenizer, "hello world how are you"), 24)
    assert len(want.split()) > 5  # the oracle produced real text, not an empty string
    assert r.choices[0].message.content == want
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None
    assert r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == len(chat_ids(tokenizer, "hello world how are you"))


def test_chat_streaming_equals_non_streaming(served: Served) -> None:
    whole = chat(served, "the water is hot", 20).choices[0].message.content
    chunks = list(
        chat(served, "the water is hot", 20, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1  # streamed
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20


def test_completions_text_and_token_prompts(served: Served, tokenizer: Any, oracle: Oracle) -> None:
    ids = [int(t) for t in tokenizer.encode("the model can read")]
    want = oracle(ids, 16)
    by_text = served.client.completions.create(
        model=MODEL_ID, prompt="the model can read", max_tokens=16, temperature=0
    )
    by_ids = served.client.completions.create(
        model=MODEL_ID, prompt=ids, max_tokens=16, temperature=0
    )
    assert by_text.choices[0].text == want
    assert by_ids.choices[0].text == want
    streamed = served.client.completions.create(
        model=MODEL_ID, prompt=ids, max_tokens=16, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == want


def test_stop_string_cuts_both_modes_alike(served: Served) -> None:
    whole = chat(served, "hello world how are you", 24).choices[0].message.content
    assert whole is not None
    words = whole.split(" ")
    stop = " " + words[4]  # cut before the fifth word's first occurrence
    want = whole[: whole.index(stop)]
    r = chat(served, "hello world how are you", 24, stop=[stop])
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "stop"
    streamed = chat(served, "hello world how are you", 24, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want


def test_four_concurrent_clients_get_their_lone_answers(served: Served) -> None:
    prompts = ["hello world", "the water is hot", "a model of the arena", "you can write"]
    lone = {p: chat(served, p, 32).choices[0].message.content for p in prompts}
    assert len(set(lone.values())) > 1  # different prompts, different answers: no cross-talk

    def ask(p: str, i: int) -> Any:
        if i % 2:  # half stream, half not: both kinds share the queue
            chunks = chat(served, p, 32, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return chat(served, p, 32).choices[0].message.content

    got = together([lambda p=p, i=i: ask(p, i) for i, p in enumerate(prompts * 2)])
    assert got == [lone[p] for p in prompts * 2]


def test_health(served: Served) -> None:
    import json
    import urllib.request

    with urllib.request.urlopen(served.url + "/health", timeout=30) as r:
        body = json.loads(r.read())
    assert r.status == 200 and body["status"] == "ok" and body["model"] == MODEL_ID
