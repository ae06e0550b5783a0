"""What every served sequence keeps to turn its sampled tokens into its job's text and end, for
either batch (serve/batch.py on mlx-lm, serve/transformers_batch.py on transformers): the
detokenizer, the stop strings held back (serve/stop.py), the counts and the times its metrics
come from."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from strata_stream.serve.jobs import Finished, Job, TextChunk
from strata_stream.serve.metrics import ServerMetrics
from strata_stream.serve.stop import StopMatcher


@dataclass(kw_only=True)
class ServedSequence:
    job: Job
    detok: Any  # the tokenizer's streaming detokenizer, used under the tokenizer lock
    stop: StopMatcher
    admitted_at: float
    first_at: float | None = None
    sampled: int = 0  # tokens sampled, EOS included: the work done
    completion: int = 0  # tokens in the answer

    def note_sampled(self, metrics: ServerMetrics) -> None:
        """Counts one sampled token; the first also gives the time to first token and the
        prompt's speed."""
        self.sampled += 1
        if self.first_at is None:
            now = time.perf_counter()
            self.first_at = now
            metrics.ttft.observe(now - self.admitted_at)
            n_prompt = len(self.job.request.prompt)
            metrics.prompt_tokens.inc(n_prompt)
            metrics.prompt_tps.set(n_prompt / max(now - self.admitted_at, 1e-9))

    def feed(self, token: int, tokenizer_lock: Any) -> bool:
        """Sends the job the token's text, less what a stop string may still claim; True when
        a stop string matched (the text before it was sent)."""
        with tokenizer_lock:
            self.detok.add_token(token)
            segment = self.detok.last_segment
        text, hit = self.stop.feed(segment)
        if text:
            self.job.emit(TextChunk(text))
        return hit

    def finished(
        self, reason: str, tokenizer_lock: Any, metrics: ServerMetrics, error: str | None = None
    ) -> Finished:
        """The job's end: on stop or length the text held back is sent first (a stop string
        completed by it still makes the reason "stop"), and the decode speed is noted."""
        if reason in ("stop", "length") and not self.stop.matched:
            with tokenizer_lock:
                self.detok.finalize()
                segment = self.detok.last_segment
            text, hit = self.stop.feed(segment)
            if hit:
                reason = "stop"
            else:
                text += self.stop.flush()
            if text:
                self.job.emit(TextChunk(text))
        if self.first_at is not None and self.sampled > 1:
            metrics.decode_tps.set(
                (self.sampled - 1) / max(time.perf_counter() - self.first_at, 1e-9)
            )
        return Finished(
            reason,
            len(self.job.request.prompt),
            self.completion,
            error=error,
            stop_sequence=self.stop.matched_stop if reason == "stop" else None,
        )
