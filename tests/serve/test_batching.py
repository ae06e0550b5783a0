"""Continuous batching (serve/batch.py) over a model whose experts stream through a small arena:
clients served together get exactly the text each gets alone; requests join and leave between
decode steps; a client that goes away leaves at the next step; a long prompt prefilled in
chunks leaves the others' text unchanged; seeded sampling does not depend on the batch; the
batch bound holds, then the queue, then 503."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from serve.harness import load_streamed, quarter_arena, serving
from serve.helpers import (
    MODEL_ID,
    TIMEOUT_S,
    GatedModel,
    client_for,
    concurrently,
    scrape,
    wait_until,
)
from serve.helpers import health as health_of
from strata_stream.convert import convert
from strata_stream.mlx_lm import stats_source
from strata_stream.pack.reader import ExpertPack
from strata_stream.serve import ServeConfig

PROMPTS = [
    "hello world",
    "the water is hot",
    "a model of the arena",
    "you can write",
    "what is the time",
    "he was in the water",
    "read the stream",
    "one layer two layer",
]


@pytest.fixture(scope="module")
def streamed(tiny_path: Path, tiny_pack: Path) -> Iterator[Any]:
    """The tiny model with its experts in a quarter-size arena (CPU experts, MLX's arithmetic:
    bitwise plain mlx-lm), loaded once; each test wraps it in its own server."""
    model, tok = load_streamed(tiny_path, tiny_pack, arena_bytes=quarter_arena(tiny_pack),
                               experts="cpu")  # fmt: skip
    try:
        yield model, tok
    finally:
        model.strata_engine.close()


Serve = Callable[..., Any]


@pytest.fixture
def serve(streamed: Any) -> Iterator[Serve]:
    """serve(gated=False, **ServeConfig fields) -> (url, gate or None): a server over the
    streamed model for this test."""
    model, tok = streamed
    with contextlib.ExitStack() as stack:

        def start(gated: bool = False, **cfg: Any) -> tuple[str, GatedModel | None]:
            m = GatedModel(model) if gated else None
            if m is not None:
                stack.callback(m.gate.set)  # opened at the end, after its server shut down
            config = ServeConfig(model_id=MODEL_ID, stats_interval_s=0.05, **cfg)
            server = stack.enter_context(serving(m or model, tok, config,
                                                 stats=stats_source(model)))  # fmt: skip
            return server.url, m

        yield start


def chat(client: openai.OpenAI, content: str, max_tokens: int, stream: bool = False,
         **kw: Any) -> str:  # fmt: skip
    msgs: Any = [{"role": "user", "content": content}]
    if not stream:
        r = client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=max_tokens,
                                           temperature=kw.pop("temperature", 0), **kw)  # fmt: skip
        return r.choices[0].message.content or ""
    chunks = client.chat.completions.create(model=MODEL_ID, messages=msgs, max_tokens=max_tokens,
                                            temperature=kw.pop("temperature", 0), stream=True,
                                            **kw)  # fmt: skip
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def alone(url: str, prompts: list[str], max_tokens: int, **kw: Any) -> dict[str, str]:
    client = client_for(url)
    return {p: chat(client, p, max_tokens, **kw) for p in prompts}


def health(url: str) -> dict[str, Any]:
    return health_of(url)[1]


def waiting_or_in_batch(url: str) -> int:
    body = health(url)
    return int(body["queue_depth"]) + int(body["batch"])


def batch_steps(url: str) -> tuple[float, float, float]:
    """(decode steps, sequences decoded over them, steps of one sequence) from /metrics."""
    m = scrape(url)
    return (
        m["strata_serve_batch_size_count"],
        m["strata_serve_batch_size_sum"],
        m['strata_serve_batch_size_bucket{le="1.0"}'],
    )


def test_clients_served_together_get_their_alone_text(serve: Serve) -> None:
    url, gate = serve(gated=True, max_batch=8)
    assert gate is not None
    gate.gate.set()
    want = alone(url, PROMPTS, 24)
    assert len(set(want.values())) == len(PROMPTS)  # different answers: cross-talk would show
    gate.gate.clear()
    client = client_for(url)
    calls = [
        lambda p=p, i=i: chat(client, p, 24, stream=bool(i % 2)) for i, p in enumerate(PROMPTS)
    ]
    steps0, seqs0, _ = batch_steps(url)
    results: list[Any] = []
    runner = threading.Thread(target=lambda: results.extend(concurrently(calls)))
    runner.start()
    # The first request holds the worker inside the model; the others queue (or were admitted
    # with it), then decode together when the gate opens.
    wait_until(lambda: waiting_or_in_batch(url) == len(PROMPTS), "every request to arrive")
    gate.gate.set()
    runner.join(TIMEOUT_S * 2)
    assert dict(zip(PROMPTS, results, strict=True)) == want
    steps, seqs, _ = batch_steps(url)
    assert seqs - seqs0 > steps - steps0  # some steps decoded several sequences at once
    m = scrape(url)
    assert m["strata_serve_queue_wait_seconds_count"] >= 2 * len(PROMPTS)
    # Expert choices summed over rows against experts looked up (once per call): a batch of 8
    # over 8 experts, top-2, shares.
    wait_until(lambda: scrape(url).get("strata_expert_sharing", 0.0) > 1.0, "shared experts")
    m = scrape(url)
    looked = m["strata_expert_hits_total"] + m["strata_expert_misses_total"]
    assert m["strata_expert_sharing"] == m["strata_expert_routed_total"] / looked


def test_requests_join_and_leave_mid_batch(serve: Serve) -> None:
    url, _ = serve(max_batch=4)
    want = alone(url, PROMPTS[:3], 40)
    want_short = alone(url, PROMPTS[3:5], 6)
    client = client_for(url)
    got: dict[str, str] = {}
    started = threading.Event()

    def long_one() -> None:
        parts = []
        stream = client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": PROMPTS[0]}],
            max_tokens=40, temperature=0, stream=True,
        )  # fmt: skip
        for c in stream:
            if c.choices and c.choices[0].delta.content:
                parts.append(c.choices[0].delta.content)
                started.set()
        got[PROMPTS[0]] = "".join(parts)

    t = threading.Thread(target=long_one)
    t.start()
    assert started.wait(TIMEOUT_S)
    # Short requests join while the long one decodes and leave before it ends; another long
    # one joins after them.
    short = concurrently([lambda p=p: chat(client, p, 6) for p in PROMPTS[3:5]])
    late = chat(client, PROMPTS[1], 40)
    t.join(TIMEOUT_S)
    assert dict(zip(PROMPTS[3:5], short, strict=True)) == want_short
    assert late == want[PROMPTS[1]]
    assert got[PROMPTS[0]] == want[PROMPTS[0]]
    steps, seqs, _ = batch_steps(url)
    assert seqs > steps


def test_a_disconnected_client_leaves_the_batch_at_the_next_step(serve: Serve) -> None:
    url, _ = serve(max_batch=4)
    want = alone(url, [PROMPTS[2]], 60)[PROMPTS[2]]
    client = client_for(url)
    cancelled = 'strata_serve_generations_total{reason="cancelled"}'
    before = scrape(url)
    other: list[str] = []
    t = threading.Thread(target=lambda: other.append(chat(client, PROMPTS[2], 60, stream=True)))
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=4000,
        temperature=0, stream=True,
    )  # fmt: skip
    t.start()
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got == 5:
            break
    stream.close()
    wait_until(lambda: scrape(url).get(cancelled, 0.0) == before.get(cancelled, 0.0) + 1,
               "the server to drop the disconnected sequence")  # fmt: skip
    t.join(TIMEOUT_S)
    assert other == [want]  # the other sequence went on, its text unchanged
    wait_until(lambda: scrape(url)["strata_serve_worker_busy"] == 0, "the batch to empty")
    after = scrape(url)
    spent = (
        after["strata_serve_generated_tokens_total"] - before["strata_serve_generated_tokens_total"]
    )
    assert spent < 4000  # the disconnected one stopped long before its budget


def test_a_long_prompt_prefilled_in_chunks_leaves_the_others_text_unchanged(
    serve: Serve,
) -> None:
    url, _ = serve(max_batch=4, prefill_chunk=16)
    want = alone(url, PROMPTS[:3], 30)
    long_prompt = " ".join(["the water is hot and you can write"] * 40)  # ~320 tokens: 20 chunks
    want_long = alone(url, [long_prompt], 8)[long_prompt]
    client = client_for(url)
    started = threading.Event()
    results: dict[str, str] = {}

    def decode_one(p: str) -> None:
        parts = []
        stream = client.chat.completions.create(
            model=MODEL_ID, messages=[{"role": "user", "content": p}], max_tokens=30,
            temperature=0, stream=True,
        )  # fmt: skip
        for c in stream:
            if c.choices and c.choices[0].delta.content:
                parts.append(c.choices[0].delta.content)
                started.set()
        results[p] = "".join(parts)

    threads = [threading.Thread(target=decode_one, args=(p,)) for p in PROMPTS[:3]]
    for t in threads:
        t.start()
    assert started.wait(TIMEOUT_S)
    results[long_prompt] = chat(client, long_prompt, 8)
    for t in threads:
        t.join(TIMEOUT_S)
    assert {p: results[p] for p in PROMPTS[:3]} == want
    assert results[long_prompt] == want_long


def test_seeded_sampling_does_not_depend_on_the_batch(serve: Serve) -> None:
    url, _ = serve(max_batch=8)
    kw = {"temperature": 1.0, "seed": 1234, "top_p": 0.9}
    want = alone(url, [PROMPTS[0]], 20, **kw)[PROMPTS[0]]
    assert alone(url, [PROMPTS[0]], 20, **kw)[PROMPTS[0]] == want  # the seed decides
    other = alone(url, [PROMPTS[0]], 20, temperature=1.0, seed=99)[PROMPTS[0]]
    assert other != want
    client = client_for(url)
    calls: list[Callable[[], Any]] = [lambda: chat(client, PROMPTS[0], 20, **dict(kw))]
    calls += [lambda p=p: chat(client, p, 20, temperature=1.0) for p in PROMPTS[1:6]]
    results = concurrently(calls)
    assert results[0] == want


def test_the_batch_bound_then_the_queue_then_503(serve: Serve) -> None:
    url, gate = serve(gated=True, max_batch=1, max_queue=1)
    assert gate is not None
    client = client_for(url)
    results: list[Any] = []
    # One at a time: two requests arriving before the worker takes the first would find the
    # one-place queue full.
    first = threading.Thread(target=lambda: results.extend(concurrently(
        [lambda: chat(client, PROMPTS[0], 4)])))  # fmt: skip
    first.start()
    assert gate.entered.wait(TIMEOUT_S)  # in the batch, held inside the model
    second = threading.Thread(target=lambda: results.extend(concurrently(
        [lambda: chat(client, PROMPTS[1], 4)])))  # fmt: skip
    second.start()
    wait_until(lambda: health(url)["queue_depth"] == 1, "the second to queue")
    assert health(url)["batch"] == 1  # the batch is full at one: the second waits
    with pytest.raises(openai.APIStatusError) as e:  # the gate is still closed: answered at once
        chat(client, PROMPTS[2], 4)
    assert e.value.status_code == 503 and e.value.code == "queue_full"
    gate.gate.set()
    first.join(TIMEOUT_S)
    second.join(TIMEOUT_S)
    assert len(results) == 2 and all(isinstance(r, str) and r for r in results)


def test_max_batch_bounds_every_decode_step(serve: Serve) -> None:
    url, _ = serve(max_batch=2)
    want = alone(url, PROMPTS[:5], 12)
    steps0, _, _ = batch_steps(url)
    client = client_for(url)
    results = concurrently([lambda p=p: chat(client, p, 12) for p in PROMPTS[:5]])
    assert dict(zip(PROMPTS[:5], results, strict=True)) == want
    m = scrape(url)
    steps = m["strata_serve_batch_size_count"]
    assert steps > steps0
    assert m['strata_serve_batch_size_bucket{le="2.0"}'] == steps  # never more than two
    assert m["strata_serve_batch_size_sum"] > m['strata_serve_batch_size_bucket{le="1.0"}']


def test_health_goes_degraded_while_reads_fail(tiny_path: Path, tmp_path: Path) -> None:
    """A damaged pack: every request fails naming layer, expert and offset (500), and /health
    reports the errors and says "degraded" (503: a generation would fail) until one succeeds
    after the pack is repaired."""
    import os

    pack = convert(tiny_path, tmp_path / "experts.strpk", progress=False)
    whole = pack.read_bytes()
    with ExpertPack.open(pack) as p:
        top_k, stride = p.geometry.top_k, p.record_stride
        first, end = p.records_offset, p.file_bytes
    model, tok = load_streamed(tiny_path, pack, arena_bytes=2 * top_k * stride, experts="cpu")
    try:
        fd = os.open(pack, os.O_WRONLY)
        try:  # every record's bytes now disagree with its checksum
            os.pwrite(fd, b"\x5a" * (end - first), first)
        finally:
            os.close(fd)
        with serving(model, tok, stats=stats_source(model)) as server:
            assert health_of(server.url)[0] == 200  # the pack's header and size still read
            client = client_for(server.url)
            for _ in range(2):
                with pytest.raises(openai.InternalServerError) as e:
                    chat(client, PROMPTS[0], 4)
                assert "layer" in str(e.value) and "expert" in str(e.value)
            status, body = health_of(server.url)
            assert status == 503 and body["status"] == "degraded"
            assert body["errors"]["count"] == 2 and body["errors"]["failing"]
            assert "layer" in body["errors"]["last"] and body["errors"]["seconds_ago"] >= 0
            pack.write_bytes(whole)  # repaired: the last error stands until a success
            assert health_of(server.url)[0] == 503
            assert chat(client, PROMPTS[0], 4)
            status, body = health_of(server.url)
            assert status == 200 and body["status"] == "ok" and not body["errors"]["failing"]
            assert body["errors"]["count"] == 2  # the history stays
    finally:
        model.strata_engine.close()


def test_sigterm_drains_the_streams_in_flight_then_ends_each_with_a_finish_reason(
    streamed: Any,
) -> None:
    import signal

    model, tok = streamed
    with serving(model, tok, ServeConfig(model_id=MODEL_ID, drain_s=0.5)) as running:
        server = running.server
        client = client_for(server.url)
        want = chat(client, PROMPTS[1], 3)  # short enough to finish within the grace
        streams = [
            client.chat.completions.create(
                model=MODEL_ID,
                messages=[{"role": "user", "content": p}],
                max_tokens=n,
                temperature=0,
                stream=True,
            )  # fmt: skip
            for p, n in ((PROMPTS[0], 4000), (PROMPTS[1], 3))
        ]
        # Both are in the batch once each has sent text: the role chunk comes before the job is
        # submitted, so it alone proves nothing (on a fast machine SIGTERM could come first).
        its = [iter(s) for s in streams]
        first: list[list[Any]] = []
        for it in its:
            got = [next(it)]
            while not (got[-1].choices and got[-1].choices[0].delta.content):
                got.append(next(it))
            first.append(got)
        server._server.handle_exit(signal.SIGTERM, None)  # what uvicorn's signal handler calls
        ends = []
        texts = []
        for it, seen in zip(its, first, strict=True):
            chunks = [*seen, *it]  # read to [DONE]: the stream ends normally, no error event
            texts.append("".join(x.choices[0].delta.content or "" for x in chunks if x.choices))
            ends.append([x.choices[0].finish_reason for x in chunks
                         if x.choices and x.choices[0].finish_reason])  # fmt: skip
        assert ends == [["length"], ["length"]]
        assert texts[1] == want  # the short one finished within the grace, unchanged
        assert 0 < len(texts[0].split()) < 4000  # the long one was cut at the grace's end


class CountingModel:
    """The real model, recording how many tokens each forward pass was given."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.tokens: list[int] = []

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        self.tokens.append(int(inputs.shape[1]))
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def test_a_long_echo_is_scored_one_chunk_per_step_while_others_decode(
    streamed: Any, reference: Callable[[list[int]], Any]
) -> None:
    """Echo's prompt log-probabilities come chunk by chunk (no forward pass of more than
    prefill_chunk tokens, so no logits larger than [chunk, vocab]), one chunk between two
    decode steps: a decoding request keeps getting tokens meanwhile, and its text is what it
    gets alone; the scores are plain mlx-lm's on the whole prompt."""
    import mlx.core as mx

    from strata_stream.serve.batch import ContinuousBatch
    from strata_stream.serve.generation import GenerationRequest, SamplingParams
    from strata_stream.serve.jobs import Finished, Job, Logprobs, TextChunk
    from strata_stream.serve.metrics import ServerMetrics

    model, tok = streamed
    chunk = 8
    counting = CountingModel(model)
    decode_ids = tuple(int(t) for t in tok.encode("hello world how are you"))
    long_ids = tuple(int(t) for t in tok.encode(" ".join(["the water is hot and you"] * 12)))
    assert len(long_ids) > 6 * chunk

    def run(with_echo: bool) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        batch = ContinuousBatch(counting, tok, max_batch=4, prefill_chunk=chunk,
                                metrics=ServerMetrics(), tokenizer_lock=threading.Lock(),
                                finish=lambda job, done: job.emit(done))  # fmt: skip
        batch.admit(Job(GenerationRequest(decode_ids, 40, SamplingParams(temperature=0)),
                        lambda e: events.append(("decode", e))))  # fmt: skip
        while not any(isinstance(e, TextChunk) for _, e in events):
            batch.step()
        if with_echo:
            echo = GenerationRequest(long_ids, 0, SamplingParams(temperature=0), logprobs=2,
                                     echo=True)  # fmt: skip
            events.append(("admitted", None))
            batch.admit(Job(echo, lambda e: events.append(("echo", e))))
        for _ in range(200):
            if not len(batch):
                break
            batch.step()
        assert not len(batch)
        mx.synchronize()
        return events

    alone_text = "".join(e.text for who, e in run(False) if isinstance(e, TextChunk))
    counting.tokens.clear()
    events = run(True)
    assert max(counting.tokens) <= chunk
    kinds = [(who, type(e).__name__) for who, e in events]
    admitted = kinds.index(("admitted", "NoneType"))
    scored = kinds.index(("echo", "Logprobs"))
    between = kinds[admitted:scored].count(("decode", "TextChunk"))
    n_chunks = -(-(len(long_ids) - 1) // chunk)
    assert between >= n_chunks - 1  # a decode step before every chunk but the first
    assert kinds[scored + 1] == ("echo", "Finished")
    text = "".join(e.text for who, e in events if who == "decode" and isinstance(e, TextChunk))
    assert text == alone_text
    entries = next(e for who, e in events if isinstance(e, Logprobs)).entries
    want = reference(list(long_ids))
    assert [x.token for x in entries] == list(long_ids) and entries[0].logprob is None
    for t in range(1, len(long_ids)):
        assert entries[t].logprob == pytest.approx(want[t - 1, long_ids[t]], abs=1e-4)
        assert entries[t].top[0][1] == pytest.approx(want[t - 1].max(), abs=1e-4)
    finished = [e for who, e in events if who == "echo" and isinstance(e, Finished)]
    assert finished[0].reason == "length" and finished[0].completion_tokens == 0
