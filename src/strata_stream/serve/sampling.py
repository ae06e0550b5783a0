"""One request's sampler and logits processors, as mlx-lm builds them, for a batch of many.

Within a batch every sequence samples on its own row of the logits with its own parameters.
Every request draws from its own key (split once per token), never from MLX's global
generator: a seeded request's key comes from its seed, so its tokens depend on its seed alone,
never on who else is in the batch; an unseeded one's from a seed the server draws from the OS.

One sequence's sampling cannot fail the others: mlx-lm's BatchGenerator calls every row's
sampler and logits processors inside one step, so an exception in one would fail the step and
every sequence in it. Each request's sampler and processors are guarded (`Fault`): an exception
is caught, the row gets a placeholder token, and the batch ends that sequence alone with the
error after the step (serve/batch.py). mlx-lm's filters are compiled with MLX's global random
state as their input and output; a trace that raises leaves that state replaced by a
placeholder array, which would fail every later draw from it and every later call of those
filters ("Attempting to eval an array without a primitive"), so after a failure the guard
seeds that state afresh (nothing here draws from it).

Every greedy request gets the same sampler object: mlx-lm's BatchGenerator samples a batch
whose sequences share one sampler in one call over all rows (an argmax per row, the same token
as alone) instead of one call per row and a concatenation, which a decode step of B greedy
sequences would otherwise pay B times. An argmax cannot fail, so it is not guarded.
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strata_stream.serve.generation import SamplingParams

log = logging.getLogger("strata_stream.serve")

Sampler = Callable[[Any], Any]
Processor = Callable[[Any, Any], Any]

# Seeds of unseeded requests: the OS's randomness, never MLX's global generator.
_SEEDS = random.SystemRandom()


@dataclass
class Fault:
    """What failed in one sequence's sampling (None: nothing); the batch reads it after each
    step and ends that sequence alone."""

    error: str | None = None


def make_sampler(sp: SamplingParams, fault: Fault | None = None) -> Sampler:
    """mlx-lm's sampler chain (top_p, min_p, top_k, then the temperature's categorical draw)
    from the request's own key; greedy at temperature 0. `fault` records an exception of this
    request's sampling instead of raising it."""
    import mlx.core as mx
    from mlx_lm import sample_utils as su

    if sp.temperature == 0:
        return _greedy()
    filters: list[Callable[[Any], Any]] = []
    if 0 < sp.top_p < 1.0:
        filters.append(lambda x: su.apply_top_p(x, sp.top_p))
    if sp.min_p != 0.0:
        filters.append(lambda x: su.apply_min_p(x, sp.min_p, 1))
    if sp.top_k > 0:
        filters.append(lambda x: su.apply_top_k(x, sp.top_k))
    seed = sp.seed if sp.seed is not None else _SEEDS.getrandbits(64)
    key = [mx.random.key(seed)]
    inv_temp = 1.0 / sp.temperature

    def sample(logprobs: Any) -> Any:
        key[0], draw = mx.random.split(key[0])
        for f in filters:
            logprobs = f(logprobs)
        return mx.random.categorical(logprobs * inv_temp, key=draw)

    return _guarded_sampler(sample, fault if fault is not None else Fault())


@functools.cache
def _greedy() -> Sampler:
    from mlx_lm import sample_utils as su

    sampler: Sampler = su.make_sampler(0.0)
    return sampler


def make_processors(sp: SamplingParams, fault: Fault | None = None) -> list[Processor]:
    from mlx_lm.sample_utils import make_logits_processors

    processors = make_logits_processors(
        repetition_penalty=sp.repetition_penalty or None,
        presence_penalty=sp.presence_penalty or None,
        frequency_penalty=sp.frequency_penalty or None,
    )
    fault = fault if fault is not None else Fault()
    return [_guarded_processor(p, fault) for p in processors]


def _guarded_sampler(sampler: Sampler, fault: Fault) -> Sampler:
    import mlx.core as mx

    def sample(logprobs: Any) -> Any:
        if fault.error is None:
            try:
                return sampler(logprobs)
            except Exception as e:
                _note(fault, "sampling", e)
        # A placeholder the batch drops with the sequence after this step.
        return mx.argmax(logprobs, axis=-1)

    return sample


def _guarded_processor(processor: Processor, fault: Fault) -> Processor:
    def process(tokens: Any, logits: Any) -> Any:
        if fault.error is None:
            try:
                return processor(tokens, logits)
            except Exception as e:
                _note(fault, "a logits processor", e)
        return logits

    return process


def _note(fault: Fault, what: str, e: Exception) -> None:
    import mlx.core as mx

    log.exception("%s failed for one sequence; it ends alone", what)
    fault.error = f"{what} failed: {e}"
    mx.random.seed(_SEEDS.getrandbits(64))  # a compiled trace that raised may have broken it
