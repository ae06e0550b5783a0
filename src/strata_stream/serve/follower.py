"""A follower rank of `strata-stream serve` under mlx.launch: it runs every request rank 0
sends over the channel (lockstep.py) with the worker's own code, and delivers nothing."""

from __future__ import annotations

import logging
from typing import Any

from strata_stream.serve.jobs import Job
from strata_stream.serve.lockstep import STOP, RequestChannel
from strata_stream.serve.metrics import ServerMetrics
from strata_stream.serve.worker import GenerationWorker

log = logging.getLogger("strata_stream.serve")


def follow(model: Any, tokenizer: Any, channel: RequestChannel) -> int:
    """A follower's loop: run every request rank 0 sends, deliver nothing; returns the number
    of requests run when rank 0 sends STOP."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    worker = GenerationWorker(model, tokenizer, max_queue=1, metrics=ServerMetrics())
    served = 0
    while True:
        message = channel.receive()
        if isinstance(message, str):
            if message == STOP:
                return served
            log.warning("rank %d: unknown control message %r", channel.rank, message)
            continue
        try:
            worker.run_one(Job(message, lambda _event: None))
        except Exception:  # as on rank 0: a failed request must not take the server down
            log.exception("rank %d: generation failed", channel.rank)
        served += 1


__all__ = ["follow"]
