"""The shape both engines' continuous batches share, and the choice between them.

The generation worker (serve/worker.py) drives one batch: mlx-lm's (`ContinuousBatch`,
serve/batch.py) or a transformers model's (`TransformersBatch`, serve/transformers_continuous.py).
Both are built with the same arguments and answer the same calls, so the worker types against
`EngineBatch` and `BatchFactory` here, never against either class: a change to one batch's
constructor or methods that the other does not share is a type error in the worker (mypy),
not a surprise at the first request on the other engine.

`batch_factory` imports the chosen class only when asked, so serving one engine never imports
the other's framework (torch for transformers, mlx for mlx-lm).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from strata_stream.serve.jobs import Finished, Job
from strata_stream.serve.lockstep import RequestChannel
from strata_stream.serve.metrics import ServerMetrics
from strata_stream.serve.prompt_cache import PromptCacheStore


class EngineBatch(Protocol):
    """A continuous batch as the worker's thread drives it (that thread alone calls it)."""

    def __len__(self) -> int:
        """Requests in the batch now (the worker admits while this is below max_batch)."""
        ...

    def admit(self, job: Job) -> None:
        """Takes the job into the batch; it starts at the next step (or finishes at once, as
        an error or a pure prompt scoring, through `finish`)."""
        ...

    def drop_cancelled(self, stopping: bool) -> None:
        """Ends the cancelled jobs ("cancelled"); every job when `stopping`."""
        ...

    def cut(self, reason: str) -> None:
        """Ends every job now with `reason` (the drain's deadline)."""
        ...

    def step(self) -> int:
        """One step of every sequence; how many sampled a token."""
        ...


class BatchFactory(Protocol):
    """The constructor both batches take: the model and tokenizer it runs, the bounds, where
    finished jobs and engine errors go, and the optional lockstep channel and prompt cache."""

    def __call__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int,
        prefill_chunk: int,
        metrics: ServerMetrics,
        tokenizer_lock: Any,
        finish: Callable[[Job, Finished], None],
        on_error: Callable[[str], None] = ...,
        lockstep: RequestChannel | None = None,
        prompt_cache: PromptCacheStore | None = None,
    ) -> EngineBatch: ...


def batch_factory(engine: str) -> BatchFactory:
    """The batch class of `engine` ("transformers", else mlx-lm's), imported now."""
    if engine == "transformers":
        from strata_stream.serve.transformers_continuous import TransformersBatch

        return TransformersBatch
    from strata_stream.serve.batch import ContinuousBatch

    return ContinuousBatch
