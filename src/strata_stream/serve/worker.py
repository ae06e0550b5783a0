"""The generation worker thread and its bounded queue.

The worker owns the model: it is the only thread that runs it (and the only caller of the
stats source, which reads the engine), so the engine is never entered by two threads at once.
It serves up to `max_batch` requests at once as one continuous batch (serve/batch.py, on
mlx-lm's BatchGenerator): requests join and leave between decode steps, in arrival order. A
transformers model is served one request at a time (serve/transformers_batch.py).
Requests beyond the batch wait in the queue; beyond `max_queue` waiting jobs, `submit` raises
QueueFullError at once (the route answers 503). Each job's events go back through the
`deliver` callable the handler supplies (it hands them to the event loop).

Under lockstep (rank 0 of a sharded model, serve/lockstep.py) the batch is the same: before
each step it sends the followers what changed in it (serve/batch.py), so they run the same.

Job lifecycle (JobState): QUEUED -> RUNNING -> FINISHED, or QUEUED -> FINISHED when cancelled
before the worker reached it. `Job.cancel()` may be called from any thread at any time; the
worker checks it before each decode step, so a cancelled job leaves at the next step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from strata_stream.engine_stats import StatsSource
from strata_stream.serve.jobs import Finished, Job, JobState
from strata_stream.serve.lockstep import STOP, RequestChannel
from strata_stream.serve.metrics import ServerMetrics

log = logging.getLogger("strata_stream.serve")


@dataclass(frozen=True)
class ErrorRecord:
    """Failed generations since start and the last one's message and time (perf_counter)."""

    count: int = 0
    last: str | None = None
    last_at: float = 0.0

    def noted(self, message: str) -> ErrorRecord:
        return ErrorRecord(self.count + 1, message, time.perf_counter())


class QueueFullError(Exception):
    pass


class WorkerStoppedError(Exception):
    pass


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
    ) -> None:
        self._model = model
        # "mlx-lm": mlx-lm's BatchGenerator (serve/batch.py); "transformers": one request at a
        # time on the model's own forward (serve/transformers_batch.py, max_batch 1).
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
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-serve-worker", daemon=True)
        metrics.queue_capacity.set(max_queue)
        metrics.queue_depth.set_function(lambda: self._queue.qsize())

    # ---- any thread --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

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
        if not self.alive:
            raise WorkerStoppedError("the generation worker is not running")
        if self.draining:
            raise WorkerStoppedError("the server is shutting down")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise QueueFullError from None

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
        batch_class: type[Any]
        if self._engine == "transformers":
            from strata_stream.serve.transformers_batch import SequentialBatch as batch_class
        else:
            from strata_stream.serve.batch import ContinuousBatch as batch_class
        batch = batch_class(
            self._model,
            self._tokenizer,
            max_batch=self.max_batch,
            prefill_chunk=self._prefill_chunk,
            metrics=self._metrics,
            tokenizer_lock=self.tokenizer_lock,
            finish=self._finish,
            on_error=self._note_error,
            lockstep=self._lockstep,
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

    def _admit(self, batch: Any) -> None:
        """Moves waiting jobs into the batch while it has room; waits briefly when idle."""
        while len(batch) < self.max_batch:
            try:
                job = self._queue.get(timeout=0.1) if not len(batch) else self._queue.get_nowait()
            except queue.Empty:
                return
            self._metrics.queue_wait.observe(time.perf_counter() - job.enqueued_at)
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
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            self._finish(job, Finished("cancelled", len(job.request.prompt), 0))

    def _finish(self, job: Job, result: Finished) -> None:
        job.state = JobState.FINISHED
        self._metrics.generations.labels(result.reason).inc()
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
