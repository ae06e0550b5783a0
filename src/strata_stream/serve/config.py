"""ServeConfig: the knobs of one server instance."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from strata_stream.errors import ConfigError
from strata_stream.serve.prompt_cache import PromptCacheConfig


@dataclass(frozen=True)
class ServeConfig:
    """model_id: the name /v1/models lists and requests must use.
    max_queue: requests waiting for the generation worker (those in the batch not counted;
      a request is one place whatever its prompt count); one more is answered 503 at once.
      64: an evaluator's concurrent requests (lm-eval's num_concurrent) wait rather than fail.
    max_batch: requests generated together, as one continuous batch.
    prefill_chunk: prompt tokens prefilled per step between decode steps.
    context_length: prompt + completion tokens allowed; None takes the model's
      max_position_embeddings (no limit when the model does not say).
    default_max_tokens: completion budget when a request gives none (capped by the context).
    stats_interval_s: how often the worker refreshes the engine snapshot while generating.
    disconnect_poll_s: how often a waiting handler checks whether its client went away.
    drain_s: on SIGTERM, how long the streams in flight may run on before each is ended
      with finish reason "length".
    prompt_cache_memory_gb: GiB of prompt caches kept in memory across requests (0: none).
    prompt_cache_dir: where prompt caches persist across restarts (None: memory only).
    prompt_cache_gb: GiB of prompt cache files kept there (least recently used out first)."""

    model_id: str
    max_queue: int = 64
    max_batch: int = 8
    prefill_chunk: int = 512
    context_length: int | None = None
    default_max_tokens: int = 512
    stats_interval_s: float = 0.5
    disconnect_poll_s: float = 0.1
    drain_s: float = 10.0
    prompt_cache_memory_gb: float = 1.0
    prompt_cache_dir: str | None = None
    prompt_cache_gb: float = 8.0

    def __post_init__(self) -> None:
        if not self.model_id:
            raise ConfigError("ServeConfig.model_id must not be empty")
        if self.max_queue < 1:
            raise ConfigError(f"ServeConfig.max_queue must be >= 1, got {self.max_queue}")
        if self.max_batch < 1:
            raise ConfigError(f"ServeConfig.max_batch must be >= 1, got {self.max_batch}")
        if self.prefill_chunk < 1:
            raise ConfigError(f"ServeConfig.prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.context_length is not None and self.context_length < 2:
            raise ConfigError(f"ServeConfig.context_length must be >= 2, got {self.context_length}")
        if self.default_max_tokens < 1:
            raise ConfigError(
                f"ServeConfig.default_max_tokens must be >= 1, got {self.default_max_tokens}"
            )
        intervals = (self.stats_interval_s, self.disconnect_poll_s, self.drain_s)
        if not all(t > 0 for t in intervals):
            raise ConfigError("ServeConfig intervals must be > 0 seconds")
        for name in ("prompt_cache_memory_gb", "prompt_cache_gb"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"ServeConfig.{name} must be a number of GiB >= 0, got {v}")

    @property
    def prompt_cache(self) -> PromptCacheConfig | None:
        """The worker's prompt cache (GenerationWorker.configure_prompt_cache); None: none."""
        if self.prompt_cache_memory_gb == 0 and self.prompt_cache_dir is None:
            return None
        return PromptCacheConfig(
            memory_bytes=int(self.prompt_cache_memory_gb * 2**30),
            directory=None if self.prompt_cache_dir is None else Path(self.prompt_cache_dir),
            disk_bytes=int(self.prompt_cache_gb * 2**30),
        )
