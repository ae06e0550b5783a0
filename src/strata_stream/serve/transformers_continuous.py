"""The transformers engine's continuous batch: up to `max_batch` requests at once, joining and
leaving between steps, on the model's own forward and KV caches.

Every sequence keeps its own cache (transformers' DynamicCache, made by its first forward;
`cache_argument` names the keyword this transformers version takes it by) and each step runs
one forward pass per sequence: a chunk of at most `prefill_chunk` prompt tokens while its
prompt is read (the last chunk also samples the first token), then one token. The passes of a
step run at once, one thread each, and meet at every streamed MoE layer (`LayerMeeting`): the
rows of all of them go to the engine as one call, which reads the union of their experts once
and computes each row as it would alone (transformers/engine.py, `run_rows`).

Why not one padded forward of all rows: torch's kernels give a row values that depend on how
many rows the call has and on the padding around it (a decode row in a gemm of 8 is not
bitwise the row of a gemv, and a left-padded prompt is not the prompt), so a padded batch
would change each client's text. Here each sequence's dense layers, attention and cache see
exactly the calls they see alone, and the experts engine is per row by construction: each
client's tokens and log-probabilities are bitwise its answer alone, whatever else is in the
batch. A prompt chunk of a joining sequence and the decode rows of the running ones share a
step for the same reason. What the batch shares is what costs most when experts stream: the
reads (and the experts' arithmetic, one call per layer).

A failed forward pass is the engine's error (/health reports it): a failure of the shared
experts call fails every sequence of that step (their caches may be half-written), a failure of
one sequence's own pass fails that sequence alone; a failure in one request's sampling ends it
alone and is not the engine's. Sampling, logits processors and log-probabilities follow
mlx-lm's definitions (serve/torch_sampling.py, serve/logprobs.py); the logits of the last
position alone are computed (logits_to_keep=1). With echo the prompt's log-probabilities come
from one pass over it when the request joins.

With a prompt cache (serve/prompt_cache.py), a request starts from the kept cache of the
longest prefix of its prompt (its prefill begins after it), and a sequence that ends with
"stop" or "length" leaves its cache (its tokens but the last sampled one) to the store.

Nothing here assumes the CPU: tensors stay on the model's device, and only each sequence's
last logits row comes to the host for sampling.
"""

from __future__ import annotations

import inspect
import logging
import threading
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

RunRows = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class _Call:
    layer: int
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    out: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


class LayerMeeting:
    """Where the forward passes of one step meet at each streamed layer: a pass's experts call
    waits until every pass still running has made its call for that layer; then the thread in
    `serve` (the worker's: a Window's turn belongs to one thread) runs them all as one
    `run_rows` and each pass gets its own rows back. A pass that ends (or fails) `leave`s, so
    the others never wait for it."""

    def __init__(self, run_rows: RunRows, parties: int) -> None:
        self._run_rows = run_rows
        self._parties = parties
        self._cond = threading.Condition()
        self._waiting: list[_Call] = []

    def run(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """A pass's experts call (on the pass's thread)."""
        call = _Call(layer, x, ids, weights)
        with self._cond:
            self._waiting.append(call)
            self._cond.notify_all()
            while not call.done:
                self._cond.wait()
        if call.error is not None:
            raise call.error
        assert call.out is not None
        return call.out

    def leave(self) -> None:
        """A pass is over (on the pass's thread)."""
        with self._cond:
            self._parties -= 1
            self._cond.notify_all()

    def serve(self) -> None:
        """Runs the passes' calls, one joined call per layer, until every pass has left."""
        while True:
            with self._cond:
                while self._parties and len(self._waiting) < self._parties:
                    self._cond.wait()
                if not self._parties:
                    return
                calls, self._waiting = self._waiting, []
            try:
                outs = self._joined(calls)
            except BaseException as e:  # every pass of the step sees the engine's error
                for c in calls:
                    c.error = e
            else:
                for c, out in zip(calls, outs, strict=True):
                    c.out = out
            with self._cond:
                for c in calls:
                    c.done = True
                self._cond.notify_all()

    def _joined(self, calls: list[_Call]) -> list[torch.Tensor]:
        if len({c.layer for c in calls}) != 1:
            raise RuntimeError(f"the batch's forward passes reached different layers "
                               f"({sorted({c.layer for c in calls})})")  # fmt: skip
        layer = calls[0].layer
        if len(calls) == 1:
            c = calls[0]
            return [self._run_rows(layer, c.x, c.ids, c.weights)]
        hidden = calls[0].x.shape[-1]
        rows = [c.x.numel() // hidden for c in calls]
        x = torch.cat([c.x.reshape(r, hidden) for c, r in zip(calls, rows, strict=True)])
        ids = torch.cat([c.ids.reshape(r, -1) for c, r in zip(calls, rows, strict=True)])
        weights = torch.cat([c.weights.reshape(r, -1) for c, r in zip(calls, rows, strict=True)])
        out = self._run_rows(layer, x, ids, weights)
        parts = torch.split(out, rows)
        return [p.reshape(c.x.shape) for p, c in zip(parts, calls, strict=True)]


@dataclass(kw_only=True)
class _Sequence(ServedSequence):
    sampler: TorchSampler
    processors: list[Processor]
    tokens: list[int] = field(default_factory=list)  # prompt and sampled: the penalties' context
    prefilled: int = 0  # prompt tokens in the cache
    cache: Any = None


@dataclass
class _Pass:
    """One sequence's forward pass of a step: its input ids and what came of them."""

    seq: _Sequence
    ids: list[int]
    logits: torch.Tensor | None = None
    error: BaseException | None = None


class TransformersBatch:
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
        self._model = model
        self._tokenizer = tokenizer
        self._max_batch = max_batch
        self._prefill_chunk = prefill_chunk
        self._metrics = metrics
        self._lock = tokenizer_lock
        self._finish_job = finish
        self._on_error = on_error
        self._eos = set(tokenizer.eos_token_ids)
        self._cache_arg = cache_argument(model)
        # The streamed experts' engine (None for a plain model: nothing to share, the passes
        # run one after another).
        self._engine = getattr(model, "strata_engine", None)
        self._seqs: list[_Sequence] = []  # in arrival order
        self._prompt_cache = prompt_cache

    def __len__(self) -> int:
        return len(self._seqs)

    # ---- joining and leaving -----------------------------------------------------------------
    def admit(self, job: Job) -> None:
        """Takes the job; its prompt is read from the next step on. With echo, the prompt's
        log-probabilities come first, from one pass over it; with max_tokens 0 they are the
        whole answer."""
        assert len(self._seqs) < self._max_batch, "the worker admits up to max_batch"
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
        s = _Sequence(job=job, detok=detok, stop=StopMatcher(req.stop),
                      sampler=TorchSampler(req.sampling), processors=make_processors(req.sampling),
                      admitted_at=time.perf_counter(), tokens=list(req.prompt))  # fmt: skip
        if self._prompt_cache is not None:
            s.cache, s.prefilled = self._prompt_cache.fetch(req.prompt)
        self._seqs.append(s)

    def drop_cancelled(self, stopping: bool) -> None:
        for s in [s for s in self._seqs if stopping or s.job.cancelled]:
            self._end(s, "cancelled")

    def cut(self, reason: str) -> None:
        for s in list(self._seqs):
            self._end(s, reason)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> int:
        """One forward pass of every sequence (a prompt chunk, or one decode token), their
        experts read together; returns how many sampled a token."""
        passes = []
        for s in self._seqs:
            prompt = s.job.request.prompt
            if s.prefilled < len(prompt):
                chunk = prompt[s.prefilled : s.prefilled + self._prefill_chunk]
                passes.append(_Pass(s, list(chunk)))
            else:
                passes.append(_Pass(s, [s.tokens[-1]]))
        self._run(passes)
        sampled = 0
        for p in passes:
            s = p.seq
            if p.error is not None:
                self._on_error(str(p.error))
                self._end(s, "error", str(p.error))
                continue
            if s.prefilled < len(s.job.request.prompt):
                s.prefilled += len(p.ids)
                if s.prefilled < len(s.job.request.prompt):
                    continue
            assert p.logits is not None
            sampled += self._sample(s, p.logits)
        if sampled:
            self._metrics.batch_size.observe(sampled)
        return sampled

    def _run(self, passes: list[_Pass]) -> None:
        """Runs the step's passes: at once, meeting at each streamed layer, when the experts
        stream and there are several; else one after another on this thread."""
        if self._engine is None or len(passes) < 2:
            for p in passes:
                self._pass(p)
            return
        meeting = LayerMeeting(self._engine.run_rows, len(passes))

        def run(p: _Pass) -> None:
            try:
                self._pass(p)
            finally:
                meeting.leave()

        threads = [threading.Thread(target=run, args=(p,), name="strata-serve-pass", daemon=True)
                   for p in passes]  # fmt: skip
        self._engine.gather = meeting.run
        try:
            for t in threads:
                t.start()
            meeting.serve()
            for t in threads:
                t.join()
        finally:
            self._engine.gather = None

    def _pass(self, p: _Pass) -> None:
        try:
            p.logits = self._forward(p.seq, p.ids).to(torch.float32).cpu()
        except Exception as e:  # a failed step must not take the server down
            log.exception("a generation step failed")
            p.error = e

    @torch.no_grad()
    def _forward(self, s: _Sequence, ids: list[int]) -> torch.Tensor:
        """The last position's logits [V] after feeding `ids` through the sequence's cache."""
        device = getattr(self._model, "device", torch.device("cpu"))
        out = self._model(input_ids=torch.tensor([ids], device=device), use_cache=True,
                          logits_to_keep=1, **{self._cache_arg: s.cache})  # fmt: skip
        s.cache = getattr(out, self._cache_arg)
        logits: torch.Tensor = out.logits[0, -1]
        return logits

    def _sample(self, s: _Sequence, row: torch.Tensor) -> int:
        try:
            for processor in s.processors:
                row = processor(s.tokens, row)
            logprobs = row - torch.logsumexp(row, dim=0)
            token = s.sampler(logprobs)
        except Exception as e:  # this request's own sampling: not the engine's fault
            log.exception("sampling failed for one sequence; it ends alone")
            self._end(s, "error", f"sampling failed: {e}")
            return 0
        self._token(s, token, logprobs)
        return 1

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
        self._seqs.remove(s)
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
