"""`strata-stream serve` under mlx.launch: rank 0 serves HTTP, the other ranks follow.

A sharded model's ranks must run the same forward passes (their collectives pair up), so every
request rank 0's worker starts is sent to the followers first, and each rank then runs the same
generation (the worker's own code, the same seed): the same tokens, hence the same stop on EOS,
a stop string or the length. A client that goes away does not stop rank 0 early (the followers
could not know): its generation runs to its end with nothing delivered. When the server stops,
rank 0 sends "stop" and the followers return (their loop: follower.py).

The channel is as mlx_lm.server shares requests: one all_sum of the message length, one of the
bytes (rank 0 contributes them, the followers zeros). The message is JSON (a request's token
ids, length, stop strings and sampling parameters), not pickle. Followers wait in that all_sum
while the server is idle: nothing crosses the network between requests.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from typing import Any, Union

from strata_stream.serve.generation import GenerationRequest, SamplingParams

log = logging.getLogger("strata_stream.serve")

STOP = "stop"
Message = Union["GenerationRequest", str]


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
        data = np.frombuffer(encode(message), dtype=np.uint8)
        n = mx.distributed.all_sum(mx.array([data.size], dtype=mx.int64), group=self.group,
                                   stream=mx.cpu)  # fmt: skip
        mx.eval(n)
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


def encode(message: Message) -> bytes:
    if isinstance(message, str):
        return json.dumps({"control": message}).encode()
    body = {
        "prompt": list(message.prompt),
        "max_tokens": message.max_tokens,
        "stop": list(message.stop),
        "sampling": dataclasses.asdict(message.sampling),
    }
    return json.dumps(body).encode()


def decode(raw: bytes) -> Message:
    body = json.loads(raw.decode())
    if "control" in body:
        return str(body["control"])
    return GenerationRequest(
        prompt=tuple(int(t) for t in body["prompt"]),
        max_tokens=int(body["max_tokens"]),
        sampling=SamplingParams(**body["sampling"]),
        stop=tuple(body["stop"]),
    )


__all__ = ["STOP", "Message", "RequestChannel", "decode", "encode", "with_seed"]
