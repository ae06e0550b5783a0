"""One request's sampler and logits processors for the transformers engine, in torch.

The same chain and the same parameters as mlx-lm's (serve/sampling.py), so a request means the
same on either engine: the logits processors (repetition, presence and frequency penalties over
the last 20 tokens, prompt included) act on the raw logits; the log-probabilities are the
processed logits normalised (what logprobs reports); top_p, min_p and top_k then mask them and
the temperature scales them for one categorical draw; temperature 0 is greedy. Everything runs
on one float32 row on the CPU, whatever device the model runs on: the row is copied to the host
once per token, which the token id needs anyway.

A seeded request draws from its own torch.Generator, so its tokens depend on its seed alone;
an unseeded one from a generator seeded by the OS, never torch's global one (the model's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from strata_stream.serve.generation import SamplingParams

# mlx-lm's context of its penalties (make_logits_processors' *_context_size defaults).
PENALTY_CONTEXT = 20

Processor = Callable[[Sequence[int], torch.Tensor], torch.Tensor]


def make_processors(sp: SamplingParams) -> list[Processor]:
    out: list[Processor] = []
    if sp.repetition_penalty:
        penalty = sp.repetition_penalty

        def repetition(tokens: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
            if tokens:
                ids = torch.tensor(sorted(set(tokens[-PENALTY_CONTEXT:])))
                picked = logits[ids]
                logits[ids] = torch.where(picked < 0, picked * penalty, picked / penalty)
            return logits

        out.append(repetition)
    if sp.presence_penalty:
        presence_penalty = sp.presence_penalty

        def presence(tokens: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
            if tokens:
                logits[torch.tensor(sorted(set(tokens[-PENALTY_CONTEXT:])))] -= presence_penalty
            return logits

        out.append(presence)
    if sp.frequency_penalty:
        frequency_penalty = sp.frequency_penalty

        def frequency(tokens: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
            if tokens:
                ids = torch.tensor(list(tokens[-PENALTY_CONTEXT:]))
                logits.index_add_(0, ids, torch.full(ids.shape, -frequency_penalty))
            return logits

        out.append(frequency)
    return out


def _top_p(logprobs: torch.Tensor, top_p: float) -> torch.Tensor:
    """mlx-lm's apply_top_p: drop the least likely tokens while the mass above them still
    reaches top_p."""
    ascending = torch.sort(logprobs).values
    probs = torch.exp(ascending)
    mass_above = torch.flip(torch.cumsum(torch.flip(probs, [0]), 0), [0]) - probs
    total = mass_above[0] + probs[0]
    dropped = int((mass_above >= top_p * total).sum())
    return torch.where(logprobs < ascending[dropped], -math.inf, logprobs)


def _min_p(logprobs: torch.Tensor, min_p: float) -> torch.Tensor:
    return torch.where(logprobs < logprobs.max() + math.log(min_p), -math.inf, logprobs)


def _top_k(logprobs: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k >= logprobs.shape[0]:
        return logprobs
    keep = torch.topk(logprobs, top_k).indices
    out = torch.full_like(logprobs, -math.inf)
    out[keep] = logprobs[keep]
    return out


class TorchSampler:
    """sample(logprobs [V] float32 on the CPU) -> token id."""

    def __init__(self, sp: SamplingParams) -> None:
        self._sp = sp
        self._gen = torch.Generator()
        if sp.seed is not None:
            self._gen.manual_seed(sp.seed)
        else:
            self._gen.seed()

    def __call__(self, logprobs: torch.Tensor) -> int:
        sp = self._sp
        if sp.temperature == 0:
            return int(torch.argmax(logprobs))
        if 0 < sp.top_p < 1.0:
            logprobs = _top_p(logprobs, sp.top_p)
        if sp.min_p != 0.0:
            logprobs = _min_p(logprobs, sp.min_p)
        if sp.top_k > 0:
            logprobs = _top_k(logprobs, sp.top_k)
        probs = torch.softmax(logprobs * (1.0 / sp.temperature), dim=0)
        return int(torch.multinomial(probs, 1, generator=self._gen))
