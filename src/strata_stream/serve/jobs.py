"""One generation as the worker runs it: a Job (its request, its state, how its events reach
the client) and the events it delivers, in order: Logprobs and TextChunk as they come, Finished
last. The worker (worker.py), the continuous batch (batch.py) and the log-probabilities
(logprobs.py) all speak these, so they live apart from any of them."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from strata_stream.serve.generation import GenerationRequest


@dataclass(frozen=True)
class TextChunk:
    text: str


@dataclass(frozen=True)
class Finished:
    """The last event of every job. reason: stop, length, cancelled or error. stop_sequence:
    the request's stop string that ended it (None for EOS and every other reason)."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    stop_sequence: str | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One token with its log-probability (None for a prompt's first token: nothing precedes
    it) and the top alternatives, most likely first."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Logprobs:
    """Log-probabilities of tokens delivered before the text they decode to. prompt: the
    echoed prompt's tokens (then no text event carries them: the route decodes the prompt)."""

    entries: tuple[TokenLogprob, ...]
    prompt: bool = False


Event = TextChunk | Logprobs | Finished


class JobState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


class Job:
    def __init__(self, request: GenerationRequest, deliver: Callable[[Event], None]) -> None:
        self.request = request
        self._deliver = deliver
        self._cancelled = threading.Event()
        self.enqueued_at = time.perf_counter()
        self.state = JobState.QUEUED  # written only by the worker thread (and submit, before)
        # Called once by cancel() (from the canceller's thread): the worker sets it on submit,
        # so a job cancelled while it waits leaves the queue at once.
        self.on_cancel: Callable[[Job], None] | None = None

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel(self)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, event: Event) -> None:
        try:
            self._deliver(event)
        except RuntimeError:  # the handler's event loop is gone: nobody is listening
            self.cancel()
