"""One client never harms another: a bad request is refused naming its field before anything
runs; a failure inside one sequence's sampling ends that sequence alone and leaves nothing
shared broken; a request takes one queue place whatever its prompt count; a waiting client
that hangs up frees its place; an over-long prompt is refused without being tokenized whole,
and tokenizing never holds up the batch; /health says whether a generation can succeed now."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx_lm
import openai
import pytest

from serve.harness import load_streamed, quarter_arena, serving
from serve.helpers import (
    MODEL_ID,
    TIMEOUT_S,
    GatedModel,
    Served,
    client_for,
    health,
    post_json,
    scrape,
    wait_until,
)
from strata_stream.convert import convert
from strata_stream.mlx_lm import stats_source

MSG = [{"role": "user", "content": "hello world"}]
# What a waiting or failing client must not take longer than to be seen (a bound, not a
# timing assertion: the state changes long before it).
PROMPTLY_S = 10.0


def vocab_size(tiny_path: Path) -> int:
    return int(json.loads((tiny_path / "config.json").read_text())["vocab_size"])


def bad_sampling(vocab: int) -> list[tuple[dict[str, Any], str]]:
    """Sampling fields outside what the model (or any arithmetic) can take, and the field."""
    return [
        ({"top_k": vocab}, "top_k"),
        ({"top_k": 2**70}, "top_k"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"max_tokens": 2**70}, "max_tokens"),
        ({"stop": ["x", "a" * 5000]}, "stop"),  # each token is matched against it
    ]


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def bad_bodies(vocab: int) -> list[tuple[str, bytes, str | None]]:
    """(route, raw body, the param the 400 must name) for every kind of client mistake."""
    out: list[tuple[str, bytes, str | None]] = []
    for fields, param in bad_sampling(vocab):
        chat = {"model": MODEL_ID, "messages": MSG, "temperature": 1.0, **fields}
        out.append(("/v1/chat/completions", json.dumps(chat).encode(), param))
        done = {"model": MODEL_ID, "prompt": "hello", "temperature": 1.0, **fields}
        out.append(("/v1/completions", json.dumps(done).encode(), param))
    head = f'{{"model": "{MODEL_ID}", "messages": {json.dumps(MSG)}, '
    out += [
        ("/v1/chat/completions", (head + f'"user": {deep(100_000)}}}').encode(), None),
        ("/v1/chat/completions",
         f'{{"model": "{MODEL_ID}", "messages": [{{"role": "user", "content": '
         f'{deep(50)}}}]}}'.encode(), "messages.0.content*"),
        ("/v1/chat/completions",
         f'{{"model": "{MODEL_ID}", "messages": [{{"role": "user", "content": '
         f'"hello \\ud800 world"}}]}}'.encode(), "messages.0.content"),
        ("/v1/completions",
         f'{{"model": "{MODEL_ID}", "prompt": "hello \\udfff"}}'.encode(), "prompt"),
        ("/v1/completions",  # a surrogate's bytes, not escaped (json.loads lets them through)
         f'{{"model": "{MODEL_ID}", "prompt": "hello '.encode() + b"\xed\xa0\x80" + b'"}',
         "prompt"),
        ("/v1/completions",
         f'{{"model": "{MODEL_ID}", "prompt": "hello", "stop": ["x", "\\ud83d"]}}'.encode(),
         "stop.1"),
    ]  # fmt: skip
    return out


# ---- item 1: sampling fields are checked against the model -------------------------------------
def test_every_bad_sampling_field_is_a_400_naming_it(served: Served, tiny_path: Path) -> None:
    for route, body, param in bad_bodies(vocab_size(tiny_path)):
        status, answer = post_json(served.url + route, body)
        assert status == 400, (route, body[:120], answer)
        got = answer["error"]["param"]
        if param is not None and param.endswith("*"):
            assert got is not None and got.startswith(param[:-1]), (body[:120], answer)
        else:
            assert got == param, (body[:120], answer)
    # Every one was refused before it ran: the server serves on, unharmed.
    r = served.client.chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=4,
                                              temperature=1.0, top_p=0.9,
                                              extra_body={"top_k": 5})  # fmt: skip
    assert r.choices[0].finish_reason in ("length", "stop")  # sampled: EOS may come first


class ClaimsAWiderVocab:
    """The real model, whose config claims twice the vocabulary its logits have: a top_k the
    validation lets through, which then fails inside mlx-lm's top-k in the batch (as any
    fault in one sequence's sampling would)."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.args = dataclasses.replace(model.args, vocab_size=2 * model.args.vocab_size)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_a_sampling_failure_ends_its_sequence_alone(tiny_path: Path) -> None:
    model, tokenizer = mlx_lm.load(str(tiny_path))
    vocab = vocab_size(tiny_path)
    gated = GatedModel(ClaimsAWiderVocab(model))
    gated.gate.set()
    with serving(gated, tokenizer) as server:
        client = client_for(server.url)
        alone = (
            client.chat.completions.create(
                model=MODEL_ID, messages=MSG, max_tokens=200, temperature=0
            )
            .choices[0]
            .message.content
        )
        # The stream is held inside its first forward pass; the bad request queues behind it
        # and joins the batch while the stream decodes.
        gated.gate.clear()
        gated.entered.clear()
        streamed: dict[str, Any] = {}

        def stream() -> None:
            chunks = client.chat.completions.create(
                model=MODEL_ID, messages=MSG, max_tokens=200, temperature=0, stream=True
            )
            parts = [(c.choices[0].delta.content or "", c.choices[0].finish_reason)
                     for c in chunks if c.choices]  # fmt: skip
            streamed["text"] = "".join(p for p, _ in parts)
            streamed["finish"] = [f for _, f in parts if f]

        runner = threading.Thread(target=stream)
        runner.start()
        assert gated.entered.wait(TIMEOUT_S)
        failed: dict[str, Any] = {}

        def bad() -> None:
            try:
                client.chat.completions.create(
                    model=MODEL_ID,
                    messages=MSG,
                    max_tokens=8,
                    temperature=1.0,
                    extra_body={"top_k": vocab},
                )
            except openai.APIStatusError as e:
                failed["error"] = e

        bad_runner = threading.Thread(target=bad)
        bad_runner.start()
        wait_until(lambda: health(server.url)[1]["queue_depth"] == 1, "the bad request to queue")
        gated.gate.set()
        bad_runner.join(TIMEOUT_S)
        runner.join(TIMEOUT_S)
        assert isinstance(failed.get("error"), openai.InternalServerError)
        assert "top_k" in str(failed["error"])
        # The other sequence in the batch went on to its end, its text as alone.
        assert streamed == {"text": alone, "finish": ["length"]}
        # Nothing shared was left broken: unseeded sampling (MLX's random state, the compiled
        # samplers) still works.
        for kw in ({}, {"top_p": 0.9}, {"extra_body": {"top_k": 5, "min_p": 0.05}}):
            r = client.chat.completions.create(model=MODEL_ID, messages=MSG, max_tokens=6,
                                               temperature=1.0, **kw)  # fmt: skip
            assert r.choices[0].finish_reason in ("length", "stop")  # EOS may be sampled
        # A request's own sampling fault is not the engine's: /health stays ok.
        assert health(server.url)[0] == 200


# ---- item 2: one queue place per request --------------------------------------------------------
def test_many_prompts_take_one_queue_place(served: Served) -> None:
    prompts = [f"hello world {w}" for w in ("the", "water", "is", "hot")] * 4
    alone = {p: served.client.completions.create(model=MODEL_ID, prompt=p, max_tokens=4,
                                                 temperature=0).choices[0].text
             for p in set(prompts)}  # fmt: skip
    r = served.client.completions.create(model=MODEL_ID, prompt=prompts, max_tokens=4,
                                         temperature=0)  # fmt: skip
    assert [c.index for c in r.choices] == list(range(16))
    assert [c.text for c in r.choices] == [alone[p] for p in prompts]


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:
            out["value"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_a_request_takes_one_place_and_a_refused_one_runs_nothing(
    gated_server: Callable[..., tuple[GatedModel, str]],
) -> None:
    g, url = gated_server(max_queue=2)
    client = client_for(url)

    def complete(prompt: str | list[str]) -> list[str]:
        r = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=3,
                                      temperature=0)  # fmt: skip
        return [c.text for c in r.choices]

    first, first_out = in_thread(lambda: complete("hello world"))
    assert g.entered.wait(TIMEOUT_S)  # in the batch, held inside the model
    second, second_out = in_thread(lambda: complete("the water"))
    wait_until(lambda: health(url)[1]["queue_depth"] == 1, "the second to queue")
    third, third_out = in_thread(lambda: complete(["you can", "a model", "the arena"]))
    wait_until(lambda: health(url)[1]["queue_depth"] == 2, "the three prompts to take one place")
    with pytest.raises(openai.APIStatusError) as e:  # the queue is full: refused at once
        complete(["one", "two", "three", "four"])
    assert e.value.status_code == 503 and e.value.code == "queue_full"
    g.gate.set()
    for t in (first, second, third):
        t.join(TIMEOUT_S)
    assert [len(o["value"]) for o in (first_out, second_out, third_out)] == [1, 1, 3]
    wait_until(lambda: health(url)[1]["batch"] == 0, "the batch to empty")
    m = scrape(url)
    # 1 + 1 + 3 generations: none of the refused request's four prompts ran.
    assert sum(v for k, v in m.items() if k.startswith("strata_serve_generations_total")) == 5


# ---- item 3: a waiting client that hangs up frees its place -------------------------------------
def send_and_hang_up(url: str, body: dict[str, Any]) -> socket.socket:
    """Sends a whole request on a raw socket and returns it (closing it hangs up)."""
    u = urllib.parse.urlsplit(url)
    sock = socket.create_connection((u.hostname or "", u.port or 80), timeout=TIMEOUT_S)
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def test_waiting_clients_that_hang_up_free_their_places(
    gated_server: Callable[..., tuple[GatedModel, str]],
) -> None:
    g, url = gated_server(max_queue=2)
    client = client_for(url)
    first, first_out = in_thread(lambda: client.completions.create(
        model=MODEL_ID, prompt="hello world", max_tokens=3, temperature=0))  # fmt: skip
    assert g.entered.wait(TIMEOUT_S)
    socks = [send_and_hang_up(url, {"model": MODEL_ID, "prompt": "the water", "max_tokens": 3,
                                    "stream": stream})
             for stream in (False, True)]  # fmt: skip
    wait_until(lambda: health(url)[1]["queue_depth"] == 2, "both to queue")
    for s in socks:
        s.close()
    wait_until(lambda: health(url)[1]["queue_depth"] == 0, "the places to be freed", PROMPTLY_S)
    later, later_out = in_thread(lambda: client.completions.create(
        model=MODEL_ID, prompt="you can", max_tokens=3, temperature=0))  # fmt: skip
    wait_until(lambda: health(url)[1]["queue_depth"] == 1 or not later.is_alive(),
               "the new client to be admitted")  # fmt: skip
    assert later.is_alive(), later_out  # waiting for the worker, not refused with 503
    g.gate.set()
    first.join(TIMEOUT_S)
    later.join(TIMEOUT_S)
    assert later_out["value"].choices[0].finish_reason == "length"
    assert first_out["value"].choices[0].finish_reason == "length"


# ---- item 4: over-long prompts, tokenizing off the batch ----------------------------------------
@pytest.fixture
def encoded(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Records the length of every text the tokenizers encode (the server's included: same
    class); a text containing GATE waits in encode until `gate` is set."""
    hf = type(tokenizer._tokenizer)
    seen: dict[str, Any] = {"longest": 0, "gate": threading.Event(), "entered": threading.Event()}
    real_encode, real_template = hf.encode, hf.apply_chat_template

    def encode(self: Any, text: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(text, str):
            seen["longest"] = max(seen["longest"], len(text))
            if "GATE" in text:
                seen["entered"].set()
                seen["gate"].wait(TIMEOUT_S)
        return real_encode(self, text, *args, **kwargs)

    def template(self: Any, messages: Any, *args: Any, **kwargs: Any) -> Any:
        seen["longest"] = max([seen["longest"]] + [len(str(m["content"])) for m in messages])
        return real_template(self, messages, *args, **kwargs)

    monkeypatch.setattr(hf, "encode", encode)
    monkeypatch.setattr(hf, "apply_chat_template", template)
    try:
        yield seen
    finally:
        seen["gate"].set()


def test_an_over_long_prompt_is_refused_before_it_is_tokenized(
    served: Served, encoded: dict[str, Any]
) -> None:
    huge = "the water is hot " * 600_000  # 10 MB; the tiny model's context is 8192 tokens
    for route, body in (
        ("/v1/completions", {"model": MODEL_ID, "prompt": huge}),
        ("/v1/completions", {"model": MODEL_ID, "prompt": ["hello", huge]}),
        ("/v1/chat/completions", {"model": MODEL_ID,
                                  "messages": [{"role": "user", "content": huge}]}),
        ("/v1/chat/completions", {"model": MODEL_ID, "messages": [
            {"role": "user", "content": [{"type": "text", "text": huge}]}]}),
        ("/v1/completions", {"model": MODEL_ID, "prompt": [5] * 3_000_000}),
    ):  # fmt: skip
        status, answer = post_json(served.url + route, json.dumps(body).encode())
        assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert "characters" in answer["error"]["message"] or "tokens" in answer["error"]["message"]
    # 400,000 one-word messages: refused by their count, before they are validated.
    many = {"model": MODEL_ID, "messages": [{"role": "user", "content": "a"}] * 400_000}
    status, answer = post_json(served.url + "/v1/chat/completions", json.dumps(many).encode())
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert "400000 messages" in answer["error"]["message"]
    # None of them was tokenized whole: at most the characters the context can spell.
    assert encoded["longest"] < len(huge) // 10
    # Past that bound, but two tokens for this tokenizer (an unknown word is one <unk>): the
    # bound alone would refuse a prompt that fits; the first characters' tokens decide.
    folded = "hello " + "q" * 250_000
    r = served.client.completions.create(model=MODEL_ID, prompt=folded, max_tokens=2)
    assert r.choices[0].finish_reason == "length" and r.usage is not None
    assert r.usage.prompt_tokens == 2


class WaitsForAnEncode:
    """The real model; its eighth forward pass (the stream is decoding) waits until another
    client's prompt is being tokenized, so the rest of the stream runs while it is."""

    def __init__(self, model: Any, encoding: threading.Event) -> None:
        self._model = model
        self._encoding = encoding
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 8 and not self._encoding.wait(TIMEOUT_S):
            raise TimeoutError("the test never started the other prompt's tokenizing")
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_tokenizing_a_prompt_never_holds_up_the_batch(
    tiny_path: Path, encoded: dict[str, Any]
) -> None:
    model, tokenizer = mlx_lm.load(str(tiny_path))
    alone = mlx_lm.generate(model, tokenizer, [5, 6, 7], max_tokens=40)
    waiting = WaitsForAnEncode(model, encoded["entered"])
    with serving(waiting, tokenizer) as server:
        client = client_for(server.url)
        # Far less than the encode is held for: a stream that waits for it fails, not hangs.
        streamer = openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                                 timeout=TIMEOUT_S / 4, max_retries=0)  # fmt: skip
        chunks = streamer.completions.create(model=MODEL_ID, prompt=[5, 6, 7], max_tokens=40,
                                             temperature=0, stream=True)  # fmt: skip
        it = iter(chunks)
        text = next(it).choices[0].text  # the stream runs; its next step waits for the encode
        slow, slow_out = in_thread(lambda: client.completions.create(
            model=MODEL_ID, prompt="GATE the water", max_tokens=2, temperature=0))  # fmt: skip
        assert encoded["entered"].wait(TIMEOUT_S)  # the other prompt is being tokenized, held
        text += "".join(c.choices[0].text for c in it)  # the stream goes on to its end meanwhile
        assert text == alone
        assert slow.is_alive()  # still tokenizing: the stream never waited for it
        encoded["gate"].set()
        slow.join(TIMEOUT_S)
        assert slow_out["value"].choices[0].finish_reason == "length"


# ---- item 5: /health tells whether a generation can succeed now ---------------------------------
def test_client_mistakes_never_touch_health(served: Served, tiny_path: Path) -> None:
    for route, body, _ in bad_bodies(vocab_size(tiny_path)):
        assert post_json(served.url + route, body)[0] == 400
    for body in (b"{broken", b"[]", json.dumps({"model": MODEL_ID, "prompt": [10**6]}).encode()):
        assert post_json(served.url + "/v1/completions", body)[0] == 400
    status, body = health(served.url)
    assert status == 200 and body["status"] == "ok", body
    assert body["errors"]["count"] == 0


@pytest.fixture
def own_pack(tiny_path: Path, tmp_path: Path) -> Iterator[tuple[Any, Any, Path]]:
    """The tiny model streamed from a pack of this test's own (quarter arena)."""
    pack = convert(tiny_path, tmp_path / "experts.strpk", progress=False)
    model, tok = load_streamed(tiny_path, pack, arena_bytes=quarter_arena(pack), experts="cpu")
    try:
        yield model, tok, pack
    finally:
        model.strata_engine.close()


def test_health_follows_the_pack(own_pack: tuple[Any, Any, Path]) -> None:
    model, tok, pack = own_pack
    whole = pack.read_bytes()
    with serving(model, tok, stats=stats_source(model)) as server:
        assert health(server.url)[0] == 200
        os.truncate(pack, len(whole) // 2)  # the pack can no longer be read whole
        wait_until(lambda: health(server.url)[0] == 503, "/health to see the pack", PROMPTLY_S)
        status, body = health(server.url)
        assert body["status"] == "degraded" and str(pack) in body["pack"]["error"]
        pack.write_bytes(whole)  # repaired
        wait_until(lambda: health(server.url)[0] == 200, "/health to see the repair", PROMPTLY_S)
        status, body = health(server.url)
        assert body["status"] == "ok" and body["pack"]["error"] is None
