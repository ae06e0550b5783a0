"""Hands jobs' events from the worker thread to the event loop: one wake-up per burst.

The batched worker emits an event per sequence per decode step. Waking the loop for each one
(a self-pipe write and a pass of the loop apiece) made eight clients cost eight wake-ups a
step, all contending with the decode loop for the GIL and, on a small machine, for the cores.
Events wait in one FIFO; the first one since the last drain schedules the drain, which hands
each to its job's queue in order (so one job's events keep their order).
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import Generic, TypeVar

T = TypeVar("T")


class Mailbox(Generic[T]):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        # Owned by _lock: the events posted since the last drain, and whether one is scheduled.
        self._items: collections.deque[tuple[asyncio.Queue[T], T]] = collections.deque()
        self._scheduled = False

    def post(self, queue: asyncio.Queue[T], event: T) -> None:
        """From any thread. RuntimeError when the loop is closed (nobody will read it)."""
        if self.loop.is_closed():
            raise RuntimeError("the event loop is closed")
        with self._lock:
            self._items.append((queue, event))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            with self._lock:
                self._scheduled = False
            raise

    def _drain(self) -> None:  # on the loop
        with self._lock:
            items, self._items = self._items, collections.deque()
            self._scheduled = False
        for queue, event in items:
            queue.put_nowait(event)


__all__ = ["Mailbox"]
