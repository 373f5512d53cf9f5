"""Admission control of generations: a cap equal to the KV slots, a bounded wait, a clear rejection past it.

A request that cannot start at once waits for a slot; at most `max_waiting` wait, each at most `timeout_s`.
Past either bound the request is rejected with CapacityError (UNAVAILABLE to the client: retry later), never
left waiting without bound. A waiting request whose client cancels leaves the queue within `poll_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from specdec.errors import CapacityError, SpecDecError

POLL_S = 0.25  # how often a waiting request checks whether its client is still there


class CancelledWhileQueued(SpecDecError):
    """The client went away before its request got a slot."""


class Admission:
    """FIFO hand-over of slots: a release passes the slot straight to the oldest waiter, so none is ever lost."""

    def __init__(self, capacity: int, max_waiting: int, timeout_s: float, poll_s: float = POLL_S) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.running = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @contextlib.asynccontextmanager
    async def slot(self, is_cancelled: Callable[[], bool] = lambda: False) -> AsyncIterator[None]:
        """Hold one of the `capacity` slots for the body; raises CapacityError when none comes in time."""
        await self._acquire(is_cancelled)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, is_cancelled: Callable[[], bool]) -> None:
        if self.running < self.capacity and not self._waiters:
            self.running += 1
            return
        if self.waiting >= self.max_waiting:
            raise CapacityError(f"server busy: {self.running} generations use all KV slots and {self.waiting} "
                                f"requests already wait (limit {self.max_waiting}); retry later")
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(granted)
        deadline = time.monotonic() + self.timeout_s
        try:
            while not granted.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CapacityError(f"server busy: no KV slot became free within {self.timeout_s:g} s; "
                                        "retry later")
                if is_cancelled():
                    raise CancelledWhileQueued("the request was cancelled while waiting for a KV slot")
                await asyncio.wait({granted}, timeout=min(self.poll_s, left))  # never cancels `granted`
        except BaseException:
            if granted.done() and not granted.cancelled():
                self._release()  # the slot arrived as we gave up: pass it on
            else:
                granted.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(granted)
            raise

    def _release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot moves to the waiter; `running` is unchanged
                return
        self.running -= 1
