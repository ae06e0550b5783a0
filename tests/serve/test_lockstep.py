"""Rank 0's side of serving a sharded model, in one process (serve/lockstep.py): every request
is sent before it runs, with a seed; a cancelled request runs on to the end the followers reach,
delivering nothing more; stopping sends STOP; a follower runs what it receives until STOP.
The real 2-rank launch is tests/distributed/test_distributed.py::test_serve_under_mlx_launch."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import mlx_lm
import pytest

from strata_stream.serve.follower import follow
from strata_stream.serve.generation import GenerationRequest, SamplingParams
from strata_stream.serve.jobs import Event, Finished, Job, TextChunk
from strata_stream.serve.lockstep import STOP, Message, decode, encode, with_seed
from strata_stream.serve.metrics import ServerMetrics
from strata_stream.serve.worker import GenerationWorker


class FakeChannel:
    """Records what rank 0 sends; replays messages to a follower."""

    def __init__(self, incoming: list[Message] | None = None) -> None:
        self.sent: list[Message] = []
        self.incoming = list(incoming or [])
        self.rank = 1

    def send(self, message: Message) -> None:
        self.sent.append(message)

    def receive(self) -> Message:
        return self.incoming.pop(0)


def run(worker: GenerationWorker, request: GenerationRequest, cancel_at_first: bool) -> list[Any]:
    events: list[Event] = []
    done = threading.Event()

    def deliver(event: Event) -> None:
        events.append(event)
        if isinstance(event, TextChunk) and cancel_at_first:
            job.cancel()
        if isinstance(event, Finished):
            done.set()

    job = Job(request, deliver)
    worker.submit(job)
    assert done.wait(60)
    return events


@pytest.fixture(scope="module")
def model(tiny_path: Path) -> tuple[Any, Any]:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    m, tok = mlx_lm.load(str(tiny_path))
    return m, tok if isinstance(tok, TokenizerWrapper) else TokenizerWrapper(tok)


def test_messages_round_trip() -> None:
    req = GenerationRequest((1, 2, 3), 7, SamplingParams(temperature=0.5, seed=9), ("x", "yz"))
    assert decode(encode(req)) == req
    assert decode(encode(STOP)) == STOP
    seeded = with_seed(GenerationRequest((1,), 2, SamplingParams()))
    assert seeded.sampling.seed is not None
    assert with_seed(req) == req


def test_rank0_sends_each_request_and_runs_cancelled_ones_to_their_end(
    model: tuple[Any, Any],
) -> None:
    m, tok = model
    request = GenerationRequest(tuple(tok.encode("w1 w2 w3")), 12, SamplingParams(temperature=0))
    channel = FakeChannel()
    metrics = ServerMetrics()
    worker = GenerationWorker(m, tok, max_queue=4, metrics=metrics, lockstep=channel)  # type: ignore[arg-type]
    counter = metrics.registry

    def generated() -> float:
        return float(counter.get_sample_value("strata_serve_generated_tokens_total") or 0.0)

    worker.start()
    try:
        before = generated()
        full = run(worker, request, cancel_at_first=False)
        n_full = generated() - before
        before = generated()
        cancelled = run(worker, request, cancel_at_first=True)
        n_cancelled = generated() - before
    finally:
        worker.stop()
    assert isinstance(full[-1], Finished) and full[-1].reason in ("stop", "length")
    assert sum(isinstance(e, TextChunk) for e in full) > 1
    # Cancelled at its first chunk: nothing more delivered, but every token the followers
    # generate was generated here too.
    assert [type(e) for e in cancelled] == [TextChunk, Finished]
    assert isinstance(cancelled[-1], Finished) and cancelled[-1].reason == "cancelled"
    assert n_cancelled == n_full > 1
    # Each request went out first, with a seed; then STOP when the worker stopped.
    assert len(channel.sent) == 3 and channel.sent[-1] == STOP
    for sent in channel.sent[:2]:
        assert isinstance(sent, GenerationRequest) and sent.prompt == request.prompt
        assert sent.sampling.seed is not None


def test_follower_runs_what_it_receives_until_stop(model: tuple[Any, Any]) -> None:
    m, tok = model
    request = GenerationRequest(tuple(tok.encode("w1 w2")), 4, SamplingParams(temperature=0))
    channel = FakeChannel([request, request, STOP, request])
    assert follow(m, tok, channel) == 2  # type: ignore[arg-type]
    assert channel.incoming == [request]  # nothing read past STOP
