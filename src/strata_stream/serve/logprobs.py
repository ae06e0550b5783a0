"""Token log-probabilities: of a prompt's own tokens (echo) and of sampled ones.

A prompt's log-probabilities come from forward passes over the prompt in chunks of at most
`chunk` tokens through a KV cache (`PromptScorer`): position t's logits score token t + 1
(what evaluators' log-likelihood tasks sum), and only one chunk's logits ([chunk, vocab]) exist
at a time, so a long prompt's scoring is bounded in memory, and the continuous batch
(serve/batch.py) runs one chunk between two decode steps, as it prefills. A
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


class PromptScorer:
    """One prompt's log-probabilities, chunk by chunk: `advance()` runs the next chunk (at most
    `chunk` tokens) through the model and its KV cache; `entries` is complete once `done`."""

    def __init__(self, model: Any, prompt: tuple[int, ...], top: int, chunk: int) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self._model = model
        self._prompt = prompt
        self._top = top
        self._chunk = chunk
        self._cache = make_prompt_cache(model)
        self._pos = 0  # tokens run through the model so far
        self.entries: list[TokenLogprob] = [TokenLogprob(prompt[0], None, ())]

    @property
    def done(self) -> bool:
        # The last token's logits score nothing: the prompt's first T - 1 tokens are enough.
        return self._pos >= len(self._prompt) - 1

    def advance(self) -> None:
        import mlx.core as mx

        if self.done:
            return
        start, end = self._pos, min(self._pos + self._chunk, len(self._prompt) - 1)
        tokens = mx.array(self._prompt[start:end])[None]
        logits = self._model(tokens, cache=self._cache)[0].astype(mx.float32)  # [n, V]
        rows = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        for i, t in enumerate(range(start + 1, end + 1)):
            self.entries.append(entry(rows[i], self._prompt[t], self._top))
        self._pos = end


def prompt_logprobs(
    model: Any, prompt: tuple[int, ...], top: int, chunk: int = 512
) -> tuple[TokenLogprob, ...]:
    """Every prompt token's log-probability given the tokens before it (None for the first),
    computed `chunk` tokens at a time."""
    scorer = PromptScorer(model, prompt, top, chunk)
    while not scorer.done:
        scorer.advance()
    return tuple(scorer.entries)
