"""`strata-stream serve` under mlx.launch: rank 0 serves HTTP, the other ranks follow.

A sharded model's ranks must run the same forward passes (their collectives pair up), so the
continuous batch is what rank 0 broadcasts: before each step of its batch (serve/batch.py),
rank 0 sends a `Step` with what changed in the batch since the last one, in order (requests
inserted, with a seed every rank samples with; sequences removed: a client gone, a stop string
matched, the shutdown's cut; the generator replaced after a failed step). Each follower applies
the same changes to its own BatchGenerator (the same insert arguments, `batch.insert_request`)
and runs the same step: the same sequences, the same tokens, hence the same ends on EOS and
length, which the generator decides itself on every rank. When the server stops, rank 0 sends
"stop" and the followers return (their loop: follower.py).

The channel is as mlx_lm.server shares requests: one all_sum of the message length, one of the
bytes (rank 0 contributes them, the followers zeros). A step that changes nothing (most of a
long generation's) is length 0 alone: one collective per step, no second one. The message is
JSON (each inserted request's token ids, length, stop strings and sampling parameters; removed
uids), not pickle. Followers wait in that all_sum while the server is idle: nothing crosses the
network while the batch is empty.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from dataclasses import dataclass
from typing import Any, Union

from strata_stream.serve.generation import GenerationRequest, SamplingParams

log = logging.getLogger("strata_stream.serve")

STOP = "stop"


@dataclass(frozen=True)
class Insert:
    request: GenerationRequest


@dataclass(frozen=True)
class Remove:
    uids: tuple[int, ...]


@dataclass(frozen=True)
class Reset:
    """A fresh generator (uids start again from 0): rank 0's step failed."""


Change = Insert | Remove | Reset


@dataclass(frozen=True)
class Step:
    """Rank 0 -> followers before each step of the batch: the batch's changes since the last
    step, in the order rank 0 made them (uids are the generator's, given in insertion order,
    so the same order gives every rank the same uids)."""

    changes: tuple[Change, ...]


Message = Union["Step", str]


class RequestChannel:
    """Rank 0 -> every other rank of `group`: requests, then STOP."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank = int(group.rank())
        self.size = int(group.size())

    def _drain(self) -> None:
        # A generation leaves a step in flight on mlx-lm's generation stream (generate_step
        # computes one token ahead); its collectives must finish before ours start on the CPU
        # stream, or the ranks would pair different collectives.
        import mlx.core as mx
        from mlx_lm.generate import generation_stream

        mx.synchronize(generation_stream)
        mx.synchronize()

    def send(self, message: Message) -> None:
        """Rank 0 only."""
        import mlx.core as mx
        import numpy as np

        assert self.rank == 0, "only rank 0 sends"
        self._drain()
        empty = isinstance(message, Step) and not message.changes
        data = np.frombuffer(b"" if empty else encode(message), dtype=np.uint8)
        n = mx.distributed.all_sum(mx.array([data.size], dtype=mx.int64), group=self.group,
                                   stream=mx.cpu)  # fmt: skip
        mx.eval(n)
        if empty:
            return
        out = mx.distributed.all_sum(mx.array(data), group=self.group, stream=mx.cpu)
        mx.eval(out)

    def receive(self) -> Message:
        """Followers: blocks until rank 0 sends."""
        import mlx.core as mx
        import numpy as np

        assert self.rank != 0, "rank 0 sends"
        self._drain()
        n = mx.distributed.all_sum(mx.zeros((1,), dtype=mx.int64), group=self.group,
                                   stream=mx.cpu)  # fmt: skip
        size = int(np.array(n)[0])
        if size == 0:
            return Step(())
        data = mx.distributed.all_sum(mx.zeros((size,), dtype=mx.uint8), group=self.group,
                                      stream=mx.cpu)  # fmt: skip
        return decode(bytes(np.array(data, dtype=np.uint8)))


def with_seed(request: GenerationRequest) -> GenerationRequest:
    """The request with a seed every rank uses (its own, or a fresh one): sampling with a
    temperature must draw the same token on every rank."""
    if request.sampling.seed is not None:
        return request
    seed = random.getrandbits(31)
    return dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, seed=seed))


def _request_body(request: GenerationRequest) -> dict[str, Any]:
    return {
        "prompt": list(request.prompt),
        "max_tokens": request.max_tokens,
        "stop": list(request.stop),
        "sampling": dataclasses.asdict(request.sampling),
    }


def _request(body: dict[str, Any]) -> GenerationRequest:
    return GenerationRequest(
        prompt=tuple(int(t) for t in body["prompt"]),
        max_tokens=int(body["max_tokens"]),
        sampling=SamplingParams(**body["sampling"]),
        stop=tuple(body["stop"]),
    )


def encode(message: Message) -> bytes:
    if isinstance(message, str):
        return json.dumps({"control": message}).encode()
    changes: list[Any] = []
    for c in message.changes:
        if isinstance(c, Insert):
            changes.append({"insert": _request_body(c.request)})
        elif isinstance(c, Remove):
            changes.append({"remove": list(c.uids)})
        else:
            changes.append({"reset": True})
    return json.dumps({"step": changes}).encode()


def decode(raw: bytes) -> Message:
    body = json.loads(raw.decode())
    if "control" in body:
        return str(body["control"])
    changes: list[Change] = []
    for c in body["step"]:
        if "insert" in c:
            changes.append(Insert(_request(c["insert"])))
        elif "remove" in c:
            changes.append(Remove(tuple(int(u) for u in c["remove"])))
        else:
            changes.append(Reset())
    return Step(tuple(changes))


__all__ = ["STOP", "Change", "Insert", "Message", "Remove", "RequestChannel", "Reset", "Step",
           "decode", "encode", "with_seed"]  # fmt: skip
