"""The generation worker thread and its bounded queue.

The worker owns the model: it is the only thread that runs it (and the only caller of the
stats source, which reads the engine), so the engine is never entered by two threads at once.
It serves up to `max_batch` requests at once as one continuous batch (serve/batch.py, on
mlx-lm's BatchGenerator; a transformers model's on serve/transformers_continuous.py): requests
join and leave between steps, in arrival order.
Requests beyond the batch wait in the queue; beyond `max_queue` waiting requests, `submit`
raises QueueFullError at once (the route answers 503) and nothing of the request runs. A
request is one place in the queue whatever its prompt count: its jobs (one per prompt) are
submitted together and join the batch in order as it has room. A waiting request whose jobs are
all cancelled (its client hung up) leaves the queue at once, freeing its place. Each job's
events go back through the `deliver` callable the handler supplies (it hands them to the event
loop).

Under lockstep (rank 0 of a sharded model, serve/lockstep.py) the batch is the same: before
each step it sends the followers what changed in it (serve/batch.py), so they run the same.

Job lifecycle (JobState): QUEUED -> RUNNING -> FINISHED, or QUEUED -> FINISHED when cancelled
before the worker reached it. `Job.cancel()` may be called from any thread at any time; the
worker checks it before each decode step, so a cancelled job leaves at the next step.

The worker's prompt cache (serve/prompt_cache.py: memory, and files when configured) is made on
its thread when it starts (the files' key hashes the model's weights) and handed to the batch.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from strata_stream.engine_stats import StatsSource
from strata_stream.serve.engine_batch import EngineBatch, batch_factory
from strata_stream.serve.jobs import Finished, Job, JobState
from strata_stream.serve.lockstep import STOP, RequestChannel
from strata_stream.serve.metrics import ServerMetrics
from strata_stream.serve.prompt_cache import PromptCacheConfig, PromptCacheStore

log = logging.getLogger("strata_stream.serve")

# Kept in memory only, unless configured otherwise (`configure_prompt_cache`).
DEFAULT_PROMPT_CACHE = PromptCacheConfig()


@dataclass(frozen=True)
class ErrorRecord:
    """Generations the engine failed since start, the last one's message and time
    (perf_counter), and whether it still stands: `failing` until a later generation succeeds.
    A client's mistake is never one (it is refused before it runs)."""

    count: int = 0
    last: str | None = None
    last_at: float = 0.0
    failing: bool = False

    def noted(self, message: str) -> ErrorRecord:
        return ErrorRecord(self.count + 1, message, time.perf_counter(), True)

    def cleared(self) -> ErrorRecord:
        return ErrorRecord(self.count, self.last, self.last_at, False)


class QueueFullError(Exception):
    pass


class WorkerStoppedError(Exception):
    pass


class WaitingRequests:
    """The queue: requests (each its jobs, one per prompt) waiting for the batch, in arrival
    order, at most `capacity` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ready = threading.Condition()
        self._requests: collections.deque[tuple[Job, ...]] = collections.deque()

    def __len__(self) -> int:
        return len(self._requests)

    def put(self, jobs: tuple[Job, ...]) -> None:
        with self._ready:
            if len(self._requests) >= self.capacity:
                raise QueueFullError
            self._requests.append(jobs)
            self._ready.notify()

    def get(self, timeout: float | None) -> tuple[Job, ...] | None:
        """The oldest request; None when none came within `timeout` (0: do not wait)."""
        with self._ready:
            if not self._requests and timeout:
                self._ready.wait(timeout)
            return self._requests.popleft() if self._requests else None

    def withdraw(self, jobs: tuple[Job, ...]) -> bool:
        """Removes the request if it still waits (not taken by the worker yet)."""
        with self._ready:
            for i, waiting in enumerate(self._requests):
                if waiting is jobs:
                    del self._requests[i]
                    return True
        return False


class GenerationWorker:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_queue: int,
        metrics: ServerMetrics,
        max_batch: int = 8,
        prefill_chunk: int = 512,
        stats: StatsSource | None = None,
        stats_interval_s: float = 0.5,
        lockstep: RequestChannel | None = None,
        engine: str = "mlx-lm",
        prompt_cache: PromptCacheConfig | None = DEFAULT_PROMPT_CACHE,
    ) -> None:
        self._model = model
        # "mlx-lm": mlx-lm's BatchGenerator (serve/batch.py); "transformers": the model's own
        # forward, one pass per sequence, experts read together (serve/transformers_continuous.py).
        self._engine = engine
        # Rank 0 of a sharded model (serve/lockstep.py): the batch's changes go to the
        # followers before each step.
        self._lockstep = lockstep
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._stats = stats
        self._stats_interval_s = stats_interval_s
        self.max_queue = max_queue
        self.max_batch = max_batch
        self._prefill_chunk = prefill_chunk
        # None: no prompt cache. Set before start() (configure_prompt_cache).
        self._prompt_cache_config = prompt_cache
        # Sequences in the batch now (written by the worker thread; /health reads it).
        self.in_flight = 0
        # Written by the worker thread only, replaced whole (one reference store), so /health
        # reads a consistent record without a lock.
        self.errors = ErrorRecord()
        # drain(): set once from the signal handler's thread; the worker thread reads it. From
        # then on no job is admitted, and the batch is cut at the deadline (perf_counter).
        self._drain_deadline: float | None = None
        # Fast tokenizers raise "Already borrowed" when two threads use one at once; handlers
        # encode prompts and the worker decodes tokens, so both take this lock.
        self.tokenizer_lock = threading.Lock()
        self._queue = WaitingRequests(max_queue)
        # Jobs of the request the worker took last that did not fit the batch yet (worker
        # thread only): they join before anything newer.
        self._pending: collections.deque[Job] = collections.deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-serve-worker", daemon=True)
        metrics.queue_capacity.set(max_queue)
        metrics.queue_depth.set_function(lambda: len(self._queue))

    # ---- any thread --------------------------------------------------------------------------
    def configure_prompt_cache(self, config: PromptCacheConfig | None) -> None:
        """The prompt cache to keep (None: none); before start()."""
        if self._thread.is_alive():
            raise RuntimeError("the prompt cache is configured before the worker starts")
        self._prompt_cache_config = config

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def queue_depth(self) -> int:
        """Requests waiting (each one place, whatever its prompt count)."""
        return len(self._queue)

    def drain(self, grace_s: float) -> None:
        """Shutting down: refuse new jobs, cancel the waiting ones, let the batch in flight
        finish for up to grace_s seconds, then end each of its sequences with finish reason
        "length" (cut before its end), so every stream closes with a finish_reason and
        [DONE] rather than being cut by the server's exit."""
        if self._drain_deadline is None:
            self._drain_deadline = time.perf_counter() + grace_s

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def submit(self, job: Job) -> None:
        self.submit_request((job,))

    def submit_request(self, jobs: Sequence[Job]) -> None:
        """Queues one request's jobs (one per prompt) as one place, or none of them:
        QueueFullError when the queue is full, WorkerStoppedError when the worker is not
        serving. A waiting request whose jobs are all cancelled leaves the queue at once."""
        if not self.alive:
            raise WorkerStoppedError("the generation worker is not running")
        if self.draining:
            raise WorkerStoppedError("the server is shutting down")
        request = tuple(jobs)
        for job in request:
            job.on_cancel = lambda _job: self._withdraw(request)
        self._queue.put(request)

    def _withdraw(self, request: tuple[Job, ...]) -> None:
        """A job of `request` was cancelled (its client went away, from the handler's thread):
        once all of them are, the request leaves the queue now and its place is free (if the
        worker took it already, the batch drops its jobs at the next step)."""
        if not all(job.cancelled for job in request) or not self._queue.withdraw(request):
            return
        for job in request:
            self._finish(job, Finished("cancelled", len(job.request.prompt), 0))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancels the running and the waiting jobs and joins the thread (the worker checks
        the stop before each step: the batch leaves at the next one)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._drain()

    # ---- the worker thread -------------------------------------------------------------------
    def _run(self) -> None:
        self._refresh_stats()
        try:
            self._run_batched()
        finally:
            if self._lockstep is not None:
                self._lockstep.send(STOP)
            self._drain()

    def _run_batched(self) -> None:
        batch = batch_factory(self._engine)(
            self._model,
            self._tokenizer,
            max_batch=self.max_batch,
            prefill_chunk=self._prefill_chunk,
            metrics=self._metrics,
            tokenizer_lock=self.tokenizer_lock,
            finish=self._finish,
            on_error=self._note_error,
            lockstep=self._lockstep,
            prompt_cache=self._open_prompt_cache(),
        )
        last_stats = time.perf_counter()
        try:
            while not self._stop.is_set():
                if self._drain_deadline is None:
                    self._admit(batch)
                else:
                    self._drain()  # waiting jobs never start: they get 503
                    if time.perf_counter() >= self._drain_deadline:
                        batch.cut("length")
                    elif not len(batch):
                        time.sleep(0.05)
                batch.drop_cancelled(stopping=False)
                self.in_flight = len(batch)
                self._metrics.busy.set(1 if len(batch) else 0)
                if not len(batch):
                    continue
                batch.step()
                if not len(batch) or time.perf_counter() - last_stats >= self._stats_interval_s:
                    last_stats = time.perf_counter()
                    self._refresh_stats()
        finally:
            batch.drop_cancelled(stopping=True)
            self.in_flight = 0
            self._metrics.busy.set(0)

    def _open_prompt_cache(self) -> PromptCacheStore | None:
        """The batch's prompt cache; None when there is none or it cannot open (the server
        serves without it, every prompt read whole)."""
        config = self._prompt_cache_config
        if config is None or self._lockstep is not None:
            return None
        if config.memory_bytes == 0 and config.directory is None:
            return None
        model = self._model
        try:
            if self._engine == "transformers":
                from strata_stream.serve.prompt_cache_torch import TorchCacheOps, torch_fingerprints

                ops: Any = TorchCacheOps(model)
                prints = lambda: torch_fingerprints(model)  # noqa: E731
            else:
                from strata_stream.serve.prompt_cache_mlx import MlxCacheOps, mlx_fingerprints

                ops = MlxCacheOps(model)
                prints = lambda: mlx_fingerprints(model)  # noqa: E731
            # torch's CPU kernels give a row values that depend on the call's row count: the
            # transformers engine reuses only whole prefill chunks (prompt_cache.py, `align`).
            align = self._prefill_chunk if self._engine == "transformers" else 0
            return PromptCacheStore(ops, config, self._metrics, prints, align)
        except Exception as e:
            log.error("the prompt cache could not open (%s); serving without it", e)
            return None

    def _next_job(self, wait: bool) -> Job | None:
        """The next job to admit: the rest of the last request first, then the queue's oldest
        request (its wait ends when its first job is taken)."""
        if not self._pending:
            request = self._queue.get(timeout=0.1 if wait else 0)
            if request is None:
                return None
            self._metrics.queue_wait.observe(time.perf_counter() - request[0].enqueued_at)
            self._pending.extend(request)
        return self._pending.popleft()

    def _admit(self, batch: EngineBatch) -> None:
        """Moves waiting jobs into the batch while it has room; waits briefly when idle."""
        while len(batch) < self.max_batch:
            job = self._next_job(wait=not len(batch))
            if job is None:
                return
            if job.cancelled or self._stop.is_set():
                self._finish(job, Finished("cancelled", len(job.request.prompt), 0))
                continue
            try:
                batch.admit(job)
            except Exception as e:  # a request the generator refuses fails alone
                log.exception("admitting a request failed")
                self._note_error(str(e))
                self._finish(job, Finished("error", len(job.request.prompt), 0, error=str(e)))

    def _note_error(self, message: str) -> None:
        self.errors = self.errors.noted(message)

    def _drain(self) -> None:
        """Cancels every waiting job (the queue's and the rest of the last request's)."""
        while True:
            job = self._pending.popleft() if self._pending else None
            if job is None:
                request = self._queue.get(timeout=0)
                if request is None:
                    return
                self._pending.extend(request)
                continue
            self._finish(job, Finished("cancelled", len(job.request.prompt), 0))

    def _finish(self, job: Job, result: Finished) -> None:
        job.state = JobState.FINISHED
        self._metrics.generations.labels(result.reason).inc()
        if result.reason in ("stop", "length") and self.errors.failing:
            self.errors = self.errors.cleared()  # a generation succeeded: the engine works
        job.emit(result)

    def _refresh_stats(self) -> None:
        if self._stats is None:
            return
        try:
            snapshot: Mapping[str, Any] = dict(self._stats())
        except Exception:
            self._metrics.stats_errors.inc()
            log.exception("the stats source failed; /metrics keeps its last snapshot")
            return
        self._metrics.set_engine_snapshot(snapshot)
