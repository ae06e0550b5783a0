"""The worker-to-event-loop mailbox: order per queue, one wake-up per burst, a closed loop."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from strata_stream.serve.mailbox import Mailbox


def test_a_burst_from_another_thread_arrives_in_order_with_one_wake_up() -> None:
    async def main() -> tuple[list[int], list[int], int]:
        loop = asyncio.get_running_loop()
        wakes = 0
        real = loop.call_soon_threadsafe

        def counting(cb: Any, *args: Any) -> Any:
            nonlocal wakes
            wakes += 1
            return real(cb, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]
        box: Mailbox[int] = Mailbox(loop)
        a: asyncio.Queue[int] = asyncio.Queue()
        b: asyncio.Queue[int] = asyncio.Queue()

        def worker() -> None:  # one decode step's events, posted while the loop is busy
            for i in range(50):
                box.post(a if i % 2 == 0 else b, i)

        t = threading.Thread(target=worker)
        t.start()
        t.join()  # the loop ran nothing meanwhile: the whole burst waits for one drain
        got_a = [await asyncio.wait_for(a.get(), 5) for _ in range(25)]
        got_b = [await asyncio.wait_for(b.get(), 5) for _ in range(25)]
        return got_a, got_b, wakes

    got_a, got_b, wakes = asyncio.run(main())
    assert got_a == list(range(0, 50, 2))
    assert got_b == list(range(1, 50, 2))
    assert wakes == 1


def test_posting_after_the_loop_closed_is_a_runtime_error() -> None:
    loop = asyncio.new_event_loop()
    box: Mailbox[int] = Mailbox(loop)
    q: asyncio.Queue[int] = asyncio.Queue()
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        box.post(q, 1)
