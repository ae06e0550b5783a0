"""The continuous batch: requests join and leave mlx-lm's BatchGenerator between decode steps.

mlx-lm's `BatchGenerator` (the primitive mlx_lm.server batches with) holds a prompt batch and a
generation batch: each `next()` runs one decode step for every generating sequence, then one
chunk (at most `prefill_chunk` tokens) of the prompts still being prefilled, so a long prompt
is spread over many steps instead of stalling every decoding client for its whole length. A
streamed model takes it unchanged: a decode step of B sequences is one routed engine call of B
rows per MoE layer, which reads the union of their experts once and computes every row bitwise
as alone (tests/test_mlx_lm_batched.py).

`ContinuousBatch` is driven by the generation worker's thread alone (it owns the model): it
admits jobs (at most `max_batch` at once: the worker keeps the rest queued), drops the
cancelled ones before each step, turns each step's tokens into text (per-sequence detokenizer,
stop strings held back as in serve/stop.py) and finishes sequences on EOS, a stop string, their
length, cancellation or an error of the step.

Under lockstep (rank 0 of a sharded model, serve/lockstep.py) it records every change it makes
to the generator (insert, remove, a fresh generator) and sends them as one `Step` before each
step, so the followers (serve/follower.py) run the same batch; requests get a seed first.

With a prompt cache (serve/prompt_cache.py; never under lockstep, whose followers hold no
such cache), a request starts from the kept cache of the longest prefix of its prompt and
prefills only the rest; a sequence that ends with "stop" or "length" leaves its cache (prompt
and answer, as the generator hands it back) to the store.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from strata_stream.serve.generation import GenerationRequest
from strata_stream.serve.jobs import Finished, Job, JobState, Logprobs
from strata_stream.serve.lockstep import (
    Change,
    Insert,
    Remove,
    RequestChannel,
    Reset,
    Step,
    with_seed,
)
from strata_stream.serve.logprobs import PromptScorer, as_row, entry
from strata_stream.serve.metrics import ServerMetrics
from strata_stream.serve.prompt_cache import PromptCacheStore
from strata_stream.serve.sampling import Fault, make_processors, make_sampler
from strata_stream.serve.sequence import ServedSequence
from strata_stream.serve.stop import StopMatcher

log = logging.getLogger("strata_stream.serve")


def new_generator(model: Any, max_batch: int, prefill_chunk: int) -> Any:
    """mlx-lm's BatchGenerator as the batch (and every follower rank) runs it."""
    from mlx_lm.generate import BatchGenerator

    return BatchGenerator(
        model,
        completion_batch_size=max_batch,
        prefill_batch_size=max_batch,
        prefill_step_size=prefill_chunk,
    )


def insert_request(
    gen: Any,
    request: GenerationRequest,
    eos: list[int],
    fault: Fault | None = None,
    cache: Any = None,
    cached: int = 0,
) -> int:
    """Inserts one request into the generator (rank 0 and every follower alike); its uid.
    `fault` records a failure of its sampling (serve/sampling.py) instead of failing the
    step. `cache`: a prompt cache of the prompt's first `cached` tokens (fewer than all), so
    only the rest is prefilled."""
    from mlx_lm.generate import StopSequences

    fault = fault if fault is not None else Fault()
    prompt = list(request.prompt)
    (uid,) = gen.insert(
        [prompt[cached:]],
        caches=None if cache is None else [cache],
        all_tokens=None if cache is None else [prompt[:cached]],
        max_tokens=[request.max_tokens],
        samplers=[make_sampler(request.sampling, fault)],
        logits_processors=[make_processors(request.sampling, fault)],
        stop_sequences=[StopSequences([(t,) for t in eos])],
    )
    return int(uid)


@dataclass(kw_only=True)
class _Sequence(ServedSequence):
    """One admitted request: its place in the generator, its progress and what failed in its
    own sampling."""

    uid: int
    fault: Fault


class ContinuousBatch:
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
        self._model = model
        self._tokenizer = tokenizer
        self._max_batch = max_batch
        self._prefill_chunk = prefill_chunk
        self._metrics = metrics
        self._lock = tokenizer_lock
        self._finish_job = finish
        self._on_error = on_error
        self._eos = sorted(set(tokenizer.eos_token_ids))
        self._seqs: dict[int, _Sequence] = {}
        # Echo requests whose prompts are being scored, one chunk per step, in arrival order.
        self._scoring: list[tuple[Job, PromptScorer]] = []
        self._lockstep = lockstep
        self._prompt_cache = prompt_cache if lockstep is None else None
        # Under lockstep: the changes made to the generator since the last step, in order.
        self._changes: list[Change] = []
        self._gen = new_generator(model, max_batch, prefill_chunk)

    def _remove(self, uids: list[int]) -> None:
        self._gen.remove(uids)
        if self._lockstep is not None:
            self._changes.append(Remove(tuple(uids)))

    def __len__(self) -> int:
        """Requests in the batch: generating (or prefilling) and having their prompts scored."""
        return len(self._seqs) + len(self._scoring)

    # ---- joining and leaving -----------------------------------------------------------------
    def admit(self, job: Job) -> None:
        """Inserts the job; it starts prefilling at the next step. With echo, the prompt's
        log-probabilities come first: one chunk of at most prefill_chunk tokens per step, as a
        prompt is prefilled, then the job joins the generator (with max_tokens 0 the scores are
        the whole answer). Under lockstep the request gets a seed (every rank must sample the
        same tokens); echo and logprobs are refused there."""
        req = job.request
        job.state = JobState.RUNNING
        if self._lockstep is not None:
            if req.echo or req.logprobs is not None:
                why = "logprobs and echo are not served across ranks (--pipeline/--tensor) yet"
                self._finish_job(job, Finished("error", len(req.prompt), 0, error=why))
                return
            req = job.request = with_seed(req)
        if req.echo:
            scorer = PromptScorer(self._model, req.prompt, req.logprobs or 0, self._prefill_chunk)
            self._scoring.append((job, scorer))
            return
        self._insert(job)

    def _insert(self, job: Job) -> None:
        req = job.request
        with self._lock:
            detok = self._tokenizer.detokenizer
        fault = Fault()
        cache, cached = None, 0
        if self._prompt_cache is not None:
            cache, cached = self._prompt_cache.fetch(req.prompt)
        uid = insert_request(self._gen, req, self._eos, fault, cache, cached)
        if self._lockstep is not None:
            self._changes.append(Insert(req))
        self._seqs[uid] = _Sequence(job=job, uid=uid, detok=detok, stop=StopMatcher(req.stop),
                                    admitted_at=time.perf_counter(), fault=fault)  # fmt: skip

    def drop_cancelled(self, stopping: bool) -> None:
        """Sequences whose client went away (or all, when the server stops) leave now."""
        for job, _ in [js for js in self._scoring if stopping or js[0].cancelled]:
            self._end_scoring(job, Finished("cancelled", len(job.request.prompt), 0))
        gone = [s for s in self._seqs.values() if stopping or s.job.cancelled]
        if gone:
            self._remove([s.uid for s in gone])
            for s in gone:
                self._end(s, "cancelled")

    def cut(self, reason: str) -> None:
        """Ends every sequence now with `reason` and the text it has (a shutdown's grace is
        over)."""
        for job, _ in list(self._scoring):
            self._end_scoring(job, Finished(reason, len(job.request.prompt), 0))
        if self._seqs:
            self._remove(list(self._seqs))
            for s in list(self._seqs.values()):
                self._end(s, reason)

    def _end_scoring(self, job: Job, result: Finished) -> None:
        self._scoring = [js for js in self._scoring if js[0] is not job]
        self._finish_job(job, result)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> int:
        """One decode step for the generating sequences, one prefill chunk and one chunk of the
        first prompt being scored; returns how many sequences decoded."""
        decoded = self._decode_step() if self._seqs else 0
        if self._scoring:
            self._score_chunk()
        return decoded

    def _score_chunk(self) -> None:
        job, scorer = self._scoring[0]
        req = job.request
        try:
            scorer.advance()
        except Exception as e:  # this request fails alone: the scorer's cache is its own
            log.exception("scoring a prompt failed")
            self._on_error(str(e))
            self._end_scoring(job, Finished("error", len(req.prompt), 0, error=str(e)))
            return
        if not scorer.done:
            return
        self._scoring.pop(0)
        job.emit(Logprobs(tuple(scorer.entries), True))
        if req.max_tokens == 0:
            self._metrics.prompt_tokens.inc(len(req.prompt))
            self._finish_job(job, Finished("length", len(req.prompt), 0))
            return
        try:
            self._insert(job)
        except Exception as e:  # a request the generator refuses fails alone
            log.exception("admitting a request failed")
            self._on_error(str(e))
            self._finish_job(job, Finished("error", len(req.prompt), 0, error=str(e)))

    def _decode_step(self) -> int:
        """One step of the generator. An error of the step fails every sequence in it (their
        caches may be half-written) and starts a fresh generator; a fault in one sequence's
        sampling ends that sequence alone (its token of this step is a placeholder)."""
        try:
            if self._lockstep is not None:
                self._lockstep.send(Step(tuple(self._changes)))
                self._changes.clear()
            _, responses = self._gen.next()
        except Exception as e:  # a failed step must not take the server down
            log.exception("a batch step failed")
            self._on_error(str(e))
            for s in list(self._seqs.values()):
                self._end(s, "error", str(e))
            self._gen = new_generator(self._model, self._max_batch, self._prefill_chunk)
            if self._lockstep is not None:
                self._changes = [Reset()]
            return 0
        if responses:
            self._metrics.batch_size.observe(len(responses))
            self._metrics.generated_tokens.inc(len(responses))
        faulted = [s for s in self._seqs.values() if s.fault.error is not None]
        if faulted:
            let_go = {r.uid for r in responses if r.finish_reason is not None}
            if still_in := [s.uid for s in faulted if s.uid not in let_go]:
                self._remove(still_in)
            for s in faulted:
                self._end(s, "error", s.fault.error)
        for r in responses:
            seq = self._seqs.get(r.uid)
            if seq is not None:
                if r.finish_reason is not None:
                    self._keep(r.all_tokens, r.prompt_cache)
                self._token(seq, int(r.token), r.finish_reason, r.logprobs)
        return len(responses)

    def _keep(self, tokens: Any, cache: Any) -> None:
        """Leaves a finished sequence's cache to the prompt cache; a failure there costs the
        next request its head start, never this one its answer."""
        if self._prompt_cache is None or cache is None or not tokens:
            return
        try:
            self._prompt_cache.store(tokens, cache)
        except Exception:
            log.exception("keeping a prompt cache failed")

    def _token(self, s: _Sequence, token: int, finish: str | None, logprobs: Any) -> None:
        s.note_sampled(self._metrics)
        if finish == "stop":  # the generator matched EOS: not part of the answer
            self._end(s, "stop")
            return
        s.completion += 1
        top = s.job.request.logprobs
        if top is not None:
            s.job.emit(Logprobs((entry(as_row(logprobs), token, top),)))
        if s.feed(token, self._lock):
            if self._prompt_cache is not None:
                kept = self._gen.remove([s.uid], return_prompt_caches=True)
                if s.uid in kept:
                    cache, tokens = kept[s.uid]
                    self._keep(tokens, cache)
            else:
                self._remove([s.uid])
            self._end(s, "stop")
        elif finish is not None:  # the length: the generator has let it go
            self._end(s, "length")

    def _end(self, s: _Sequence, reason: str, error: str | None = None) -> None:
        del self._seqs[s.uid]
        self._finish_job(s.job, s.finished(reason, self._lock, self._metrics, error))
