"""What one generation is asked to do: the prompt's tokens, the length, stop strings and
sampling. The worker runs it (worker.py); under mlx.launch rank 0 sends it to the other ranks
(lockstep.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 0.0
    seed: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """max_tokens may be 0 only with echo (the prompt's log-probabilities alone).
    logprobs: None for none, else how many top alternatives each token reports (0..20).
    echo: the prompt's own tokens and log-probabilities come first (serve/logprobs.py)."""

    prompt: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    echo: bool = False


__all__ = ["GenerationRequest", "SamplingParams"]
