"""One request's sampler and logits processors, as mlx-lm builds them, for a batch of many.

Within a batch every sequence samples on its own row of the logits with its own parameters.
A seeded request draws from its own key (split once per token), not from MLX's global
generator, so its tokens depend on its seed alone, never on who else is in the batch.

Every greedy request gets the same sampler object: mlx-lm's BatchGenerator samples a batch
whose sequences share one sampler in one call over all rows (an argmax per row, the same token
as alone) instead of one call per row and a concatenation, which a decode step of B greedy
sequences would otherwise pay B times.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strata_stream.serve.generation import SamplingParams

Sampler = Callable[[Any], Any]


def make_sampler(sp: SamplingParams) -> Sampler:
    """mlx-lm's sampler chain (top_p, min_p, top_k, then the temperature's categorical draw);
    greedy at temperature 0. With a seed, the draw takes the request's own key."""
    import mlx.core as mx
    from mlx_lm import sample_utils as su

    if sp.temperature == 0:
        return _greedy()
    if sp.seed is None:
        return su.make_sampler(sp.temperature, top_p=sp.top_p, min_p=sp.min_p, top_k=sp.top_k)
    filters: list[Callable[[Any], Any]] = []
    if 0 < sp.top_p < 1.0:
        filters.append(lambda x: su.apply_top_p(x, sp.top_p))
    if sp.min_p != 0.0:
        filters.append(lambda x: su.apply_min_p(x, sp.min_p, 1))
    if sp.top_k > 0:
        filters.append(lambda x: su.apply_top_k(x, sp.top_k))
    key = [mx.random.key(sp.seed)]
    inv_temp = 1.0 / sp.temperature

    def sample(logprobs: Any) -> Any:
        key[0], draw = mx.random.split(key[0])
        for f in filters:
            logprobs = f(logprobs)
        return mx.random.categorical(logprobs * inv_temp, key=draw)

    return sample


@functools.cache
def _greedy() -> Sampler:
    from mlx_lm import sample_utils as su

    sampler: Sampler = su.make_sampler(0.0)
    return sampler


def make_processors(sp: SamplingParams) -> list[Any]:
    from mlx_lm.sample_utils import make_logits_processors

    return list(
        make_logits_processors(
            repetition_penalty=sp.repetition_penalty or None,
            presence_penalty=sp.presence_penalty or None,
            frequency_penalty=sp.frequency_penalty or None,
        )
    )
