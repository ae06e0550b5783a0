"""A follower rank of `strata-stream serve` under mlx.launch: it runs the batch rank 0
broadcasts (lockstep.py): before each of rank 0's steps it applies the same changes to its own
BatchGenerator (the same insert arguments, serve/batch.py's `insert_request`) and runs the same
step; it delivers nothing."""

from __future__ import annotations

import logging
from typing import Any

from strata_stream.serve.batch import insert_request, new_generator
from strata_stream.serve.lockstep import STOP, Insert, Remove, RequestChannel

log = logging.getLogger("strata_stream.serve")


def follow(
    model: Any, tokenizer: Any, channel: RequestChannel, *, max_batch: int = 8,
    prefill_chunk: int = 512,
) -> int:  # fmt: skip
    """A follower's loop: apply each Step rank 0 sends and run it, deliver nothing; returns
    the number of requests inserted when rank 0 sends STOP. max_batch and prefill_chunk must
    be rank 0's (every rank runs the same command line): they decide when a prompt joins."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    eos = sorted(set(tokenizer.eos_token_ids))
    gen = new_generator(model, max_batch, prefill_chunk)
    served = 0
    while True:
        message = channel.receive()
        if isinstance(message, str):
            if message == STOP:
                return served
            log.warning("rank %d: unknown control message %r", channel.rank, message)
            continue
        for change in message.changes:
            if isinstance(change, Insert):
                insert_request(gen, change.request, eos)
                served += 1
            elif isinstance(change, Remove):
                gen.remove(list(change.uids))
            else:  # Reset: rank 0's step failed and it started a fresh generator
                gen = new_generator(model, max_batch, prefill_chunk)
        try:
            gen.next()
        except Exception:  # as on rank 0: a failed step must not take the server down
            log.exception("rank %d: a batch step failed", channel.rank)


__all__ = ["follow"]
