"""Rank 0's side of serving a sharded model, in one process (serve/lockstep.py): before each
step of its batch rank 0 sends what changed in it (requests inserted with a seed, sequences
removed: a cancelled one leaves at the next step); stopping sends STOP; a follower fed rank 0's
messages runs the same batch, token for token, until STOP.
The real 2-rank launch is tests/distributed/test_distributed.py::test_serve_under_mlx_launch."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import mlx_lm
import pytest

import strata_stream.serve.batch as batch_mod
import strata_stream.serve.follower as follower_mod
from strata_stream.serve.follower import follow
from strata_stream.serve.generation import GenerationRequest, SamplingParams
from strata_stream.serve.jobs import Event, Finished, Job, TextChunk
from strata_stream.serve.lockstep import (
    STOP,
    Insert,
    Message,
    Remove,
    Reset,
    Step,
    decode,
    encode,
    with_seed,
)
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


def submit(worker: GenerationWorker, request: GenerationRequest, cancel_at_first: bool
           ) -> tuple[list[Event], threading.Event]:  # fmt: skip
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
    return events, done


@pytest.fixture(scope="module")
def model(tiny_path: Path) -> tuple[Any, Any]:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    m, tok = mlx_lm.load(str(tiny_path))
    return m, tok if isinstance(tok, TokenizerWrapper) else TokenizerWrapper(tok)


def recording(module: Any, monkeypatch: pytest.MonkeyPatch) -> list[list[tuple[int, int]]]:
    """Every step's (uid, token) pairs of the generators `module` makes from now on."""
    steps: list[list[tuple[int, int]]] = []
    make = module.new_generator

    def new_generator(*args: Any) -> Any:
        gen = make(*args)
        step = gen.next

        def next_() -> Any:
            prompts, responses = step()
            steps.append([(int(r.uid), int(r.token)) for r in responses])
            return prompts, responses

        gen.next = next_
        return gen

    monkeypatch.setattr(module, "new_generator", new_generator)
    return steps


def test_messages_round_trip() -> None:
    req = GenerationRequest((1, 2, 3), 7, SamplingParams(temperature=0.5, seed=9), ("x", "yz"))
    step = Step((Insert(req), Remove((3, 1)), Reset(), Insert(with_seed(req))))
    assert decode(encode(step)) == step
    assert decode(encode(Step(()))) == Step(())
    assert decode(encode(STOP)) == STOP
    seeded = with_seed(GenerationRequest((1,), 2, SamplingParams()))
    assert seeded.sampling.seed is not None
    assert with_seed(req) == req


def test_rank0_broadcasts_its_batch_and_a_follower_runs_the_same(
    model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    m, tok = model
    sampled = GenerationRequest(
        tuple(tok.encode("w1 w2 w3")), 12, SamplingParams(temperature=1, seed=5)
    )
    greedy = GenerationRequest(tuple(tok.encode("w4 w1")), 10, SamplingParams(temperature=0))
    channel = FakeChannel()
    rank0 = recording(batch_mod, monkeypatch)
    worker = GenerationWorker(m, tok, max_queue=4, metrics=ServerMetrics(), max_batch=4,
                              lockstep=channel)  # type: ignore[arg-type]  # fmt: skip
    worker.start()
    try:
        runs = [submit(worker, r, cancel) for r, cancel in
                ((sampled, False), (greedy, True), (greedy, False))]  # fmt: skip
        for _, done in runs:
            assert done.wait(60)
    finally:
        worker.stop()
    (full, _), (cancelled, _), (second, _) = runs
    assert isinstance(full[-1], Finished) and full[-1].reason in ("length", "stop")
    # Cancelled at its first chunk: it left at the next step, nothing more delivered.
    assert [type(e) for e in cancelled] == [TextChunk, Finished]
    assert isinstance(cancelled[-1], Finished) and cancelled[-1].reason == "cancelled"
    assert isinstance(second[-1], Finished) and second[-1].reason == "length"
    # A Step before every step, then STOP; every request inserted once, with a seed.
    assert channel.sent[-1] == STOP
    steps = channel.sent[:-1]
    assert all(isinstance(s, Step) for s in steps) and len(steps) == len(rank0)
    changes = [c for s in steps if isinstance(s, Step) for c in s.changes]
    inserted = [c.request for c in changes if isinstance(c, Insert)]
    assert [r.prompt for r in inserted] == [sampled.prompt, greedy.prompt, greedy.prompt]
    assert all(r.sampling.seed is not None for r in inserted)
    removed = [u for c in changes if isinstance(c, Remove) for u in c.uids]
    assert len(removed) == 1  # the cancelled one; the others ended by their length
    # A follower fed the same messages runs the same steps, token for token.
    follower = recording(follower_mod, monkeypatch)
    assert follow(m, tok, FakeChannel(list(channel.sent)), max_batch=4) == 3  # type: ignore[arg-type]
    assert follower == rank0 and sum(map(len, rank0)) > 12


def test_follower_runs_what_it_receives_until_stop(model: tuple[Any, Any]) -> None:
    m, tok = model
    request = GenerationRequest(tuple(tok.encode("w1 w2")), 4, SamplingParams(temperature=0))
    step = Step((Insert(request),))
    channel = FakeChannel([step, Step(()), step, STOP, step])
    assert follow(m, tok, channel) == 2  # type: ignore[arg-type]
    assert channel.incoming == [step]  # nothing read past STOP
