"""The transformers engine's batch: one request at a time, on the model's own forward and KV
cache.

`SequentialBatch` has ContinuousBatch's surface (serve/batch.py: admit, drop_cancelled, cut,
step), so the generation worker drives either alike, but it holds at most one sequence: the
server runs it with max_batch 1 and the other requests wait in the queue. (Batching
transformers models of different prompt lengths needs padded, position-aware caches; the
engine under them would take the rows as one call, but that front-end is not built yet.)

Each step runs one forward pass of the model (a transformers PreTrainedModel, streamed or
plain) on the worker's thread: a chunk of at most `prefill_chunk` prompt tokens while the
prompt is read (the last chunk also samples the first token), then one token per step. A
failed forward pass is the engine's error (/health reports it); a failure in the request's
own sampling ends it alone and is not. The
cache is transformers' own dynamic cache, made by the first forward (`cache_argument` names
the keyword this transformers version takes it by); the logits of the last
position alone are computed (logits_to_keep=1). Sampling, logits processors and
log-probabilities follow mlx-lm's definitions (serve/torch_sampling.py, serve/logprobs.py).

With a prompt cache (serve/prompt_cache.py), a request starts from the kept cache of the
longest prefix of its prompt (its prefill begins after it), and a sequence that ends with
"stop" or "length" leaves its cache (its tokens but the last sampled one) to the store.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from strata_stream.serve.jobs import Finished, Job, JobState, Logprobs, TokenLogprob
from strata_stream.serve.lockstep import RequestChannel
from strata_stream.serve.logprobs import entry
from strata_stream.serve.metrics import ServerMetrics
from strata_stream.serve.prompt_cache import PromptCacheStore
from strata_stream.serve.sequence import ServedSequence
from strata_stream.serve.stop import StopMatcher
from strata_stream.serve.torch_sampling import Processor, TorchSampler, make_processors

log = logging.getLogger("strata_stream.serve")


@dataclass(kw_only=True)
class _Sequence(ServedSequence):
    sampler: TorchSampler
    processors: list[Processor]
    tokens: list[int] = field(default_factory=list)  # prompt and sampled: the penalties' context
    prefilled: int = 0  # prompt tokens in the cache
    cache: Any = None


class SequentialBatch:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_batch: int,
        prefill_chunk: int,
        metrics: ServerMetrics,
        tokenizer_lock: Any,
        finish: Callable[[Job, Finished], None],
        on_error: Callable[[str], None] = lambda message: None,
        lockstep: RequestChannel | None = None,
        prompt_cache: PromptCacheStore | None = None,
    ) -> None:
        if lockstep is not None:  # serve() refuses --pipeline/--tensor with this engine first
            raise ValueError("the transformers engine does not serve across ranks")
        if max_batch != 1:
            raise ValueError(f"the transformers engine serves one request at a time, not "
                             f"{max_batch}")  # fmt: skip
        self._model = model
        self._tokenizer = tokenizer
        self._prefill_chunk = prefill_chunk
        self._metrics = metrics
        self._lock = tokenizer_lock
        self._finish_job = finish
        self._on_error = on_error
        self._eos = set(tokenizer.eos_token_ids)
        self._cache_arg = cache_argument(model)
        self._seq: _Sequence | None = None
        self._prompt_cache = prompt_cache

    def __len__(self) -> int:
        return 0 if self._seq is None else 1

    # ---- joining and leaving -----------------------------------------------------------------
    def admit(self, job: Job) -> None:
        """Takes the job; its prompt is read from the next step on. With echo, the prompt's
        log-probabilities come first, from one pass over it; with max_tokens 0 they are the
        whole answer."""
        assert self._seq is None, "SequentialBatch holds one sequence"
        req = job.request
        job.state = JobState.RUNNING
        if req.echo:
            try:
                scored = prompt_logprobs(self._model, req.prompt, req.logprobs or 0)
            except Exception as e:
                log.exception("scoring a prompt failed")
                self._on_error(str(e))
                self._finish_job(job, Finished("error", len(req.prompt), 0, error=str(e)))
                return
            job.emit(Logprobs(scored, True))
            if req.max_tokens == 0:
                self._metrics.prompt_tokens.inc(len(req.prompt))
                self._finish_job(job, Finished("length", len(req.prompt), 0))
                return
        with self._lock:
            detok = self._tokenizer.detokenizer
        self._seq = _Sequence(job=job, detok=detok, stop=StopMatcher(req.stop),
                              sampler=TorchSampler(req.sampling),
                              processors=make_processors(req.sampling),
                              admitted_at=time.perf_counter(), tokens=list(req.prompt))  # fmt: skip
        if self._prompt_cache is not None:
            self._seq.cache, self._seq.prefilled = self._prompt_cache.fetch(req.prompt)

    def drop_cancelled(self, stopping: bool) -> None:
        s = self._seq
        if s is not None and (stopping or s.job.cancelled):
            self._end(s, "cancelled")

    def cut(self, reason: str) -> None:
        if self._seq is not None:
            self._end(self._seq, reason)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> int:
        """One forward pass: a prompt chunk, or one decode token. Returns 1 when a token was
        sampled. An error ends the sequence with it (its cache may be half-written)."""
        s = self._seq
        if s is None:
            return 0
        prompt = s.job.request.prompt
        try:
            if s.prefilled < len(prompt):
                chunk = list(prompt[s.prefilled : s.prefilled + self._prefill_chunk])
                logits = self._forward(s, chunk)
                s.prefilled += len(chunk)
                if s.prefilled < len(prompt):
                    return 0
            else:
                logits = self._forward(s, [s.tokens[-1]])
            row = logits.to(torch.float32).cpu()
        except Exception as e:  # a failed step must not take the server down
            log.exception("a generation step failed")
            self._on_error(str(e))
            self._end(s, "error", str(e))
            return 0
        try:
            for processor in s.processors:
                row = processor(s.tokens, row)
            logprobs = row - torch.logsumexp(row, dim=0)
            token = s.sampler(logprobs)
        except Exception as e:  # this request's own sampling: not the engine's fault
            log.exception("sampling failed for one sequence; it ends alone")
            self._end(s, "error", f"sampling failed: {e}")
            return 0
        self._metrics.batch_size.observe(1)
        self._token(s, token, logprobs)
        return 1

    @torch.no_grad()
    def _forward(self, s: _Sequence, ids: list[int]) -> torch.Tensor:
        """The last position's logits [V] after feeding `ids` through the sequence's cache."""
        device = getattr(self._model, "device", torch.device("cpu"))
        out = self._model(input_ids=torch.tensor([ids], device=device), use_cache=True,
                          logits_to_keep=1, **{self._cache_arg: s.cache})  # fmt: skip
        s.cache = getattr(out, self._cache_arg)
        logits: torch.Tensor = out.logits[0, -1]
        return logits

    def _token(self, s: _Sequence, token: int, logprobs: torch.Tensor) -> None:
        req = s.job.request
        s.note_sampled(self._metrics)
        s.tokens.append(token)
        self._metrics.generated_tokens.inc()
        if token in self._eos:  # not part of the answer
            self._end(s, "stop")
            return
        s.completion += 1
        if req.logprobs is not None:
            row = logprobs.numpy()
            s.job.emit(Logprobs((entry(row, token, req.logprobs),)))
        if s.feed(token, self._lock):
            self._end(s, "stop")
        elif s.sampled >= req.max_tokens:
            self._end(s, "length")

    def _end(self, s: _Sequence, reason: str, error: str | None = None) -> None:
        self._seq = None
        if self._prompt_cache is not None and reason in ("stop", "length") and s.cache is not None:
            try:  # the cache holds every token but the last sampled one
                self._prompt_cache.store(s.tokens[:-1], s.cache, len(s.job.request.prompt))
            except Exception:  # the next request loses its head start, never this its answer
                log.exception("keeping a prompt cache failed")
        self._finish_job(s.job, s.finished(reason, self._lock, self._metrics, error))


def cache_argument(model: Any) -> str:
    """The name under which the model's forward takes (and its output returns) the KV cache:
    `cache` from transformers 5.24 on (where `past_key_values` is deprecated), else
    `past_key_values`."""
    forward = getattr(type(model), "forward", None)
    try:
        params = inspect.signature(forward).parameters if forward is not None else {}
    except (TypeError, ValueError):
        params = {}
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def prompt_logprobs(model: Any, prompt: tuple[int, ...], top: int) -> tuple[TokenLogprob, ...]:
    """Every prompt token's log-probability given the tokens before it (None for the first),
    from one forward pass without a cache."""
    device = getattr(model, "device", torch.device("cpu"))
    logits = model(input_ids=torch.tensor([prompt], device=device), use_cache=False).logits
    rows = torch.log_softmax(logits[0].to(torch.float32), dim=-1).cpu().numpy()
    out = [TokenLogprob(prompt[0], None, ())]
    for t in range(1, len(prompt)):
        out.append(entry(np.ascontiguousarray(rows[t - 1]), prompt[t], top))
    return tuple(out)
