"""Token log-probabilities: of a prompt's own tokens (echo) and of sampled ones.

A prompt's log-probabilities come from one forward pass over the whole prompt, without a
cache: position t's logits score token t + 1 (what evaluators' log-likelihood tasks sum). A
sampled token's come from the row of log-probabilities it was sampled from (after the logits
processors, as mlx-lm's BatchGenerator normalises them). The token's own value and the top
alternatives are read from the same array, so a greedy token's logprob equals the top one
exactly (lm-eval's is_greedy test compares them with ==).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from strata_stream.serve.jobs import TokenLogprob


def top_of(row: npt.NDArray[np.float32], n: int) -> tuple[tuple[int, float], ...]:
    """The n most likely tokens of one row of log-probabilities, most likely first (ties to the
    lower id)."""
    if n <= 0:
        return ()
    n = min(n, row.shape[0])
    part = np.argpartition(-row, n - 1)[:n]
    order = sorted(part.tolist(), key=lambda t: (-float(row[t]), t))
    return tuple((int(t), float(row[t])) for t in order)


def entry(row: npt.NDArray[np.float32], token: int, top: int) -> TokenLogprob:
    return TokenLogprob(token, float(row[token]), top_of(row, top))


def as_row(logprobs: Any) -> npt.NDArray[np.float32]:
    """An mx.array of log-probabilities [V] as float32 numpy."""
    import mlx.core as mx

    return np.array(logprobs.astype(mx.float32))


def prompt_logprobs(model: Any, prompt: tuple[int, ...], top: int) -> tuple[TokenLogprob, ...]:
    """Every prompt token's log-probability given the tokens before it (None for the first)."""
    import mlx.core as mx

    logits = model(mx.array(prompt)[None])[0].astype(mx.float32)  # [T, V]
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    rows = np.array(lp)
    out = [TokenLogprob(prompt[0], None, ())]
    for t in range(1, len(prompt)):
        out.append(entry(rows[t - 1], prompt[t], top))
    return tuple(out)
