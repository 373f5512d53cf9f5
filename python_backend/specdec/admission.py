"""Admission control of generations: a cap on live sequences and on KV memory, a bounded wait, a clear
rejection past it.

A generation starts when a sequence slot is free and the KV pool (specdec.kv_memory) can hold its worst case:
`kv_blocks` is the pool's size in blocks, and a generation reserves the blocks of prompt + max_tokens rows
(the most its sequence can hold in the target and in the draft), so a running generation never meets a
full pool and is never preempted. The decoders allocate blocks as rows are written; the reservation is the
ceiling. A request that cannot start at once waits; at most `max_waiting` wait, each at most `timeout_s`.
Past either bound the request is rejected with CapacityError (UNAVAILABLE to the client: retry later), never
left waiting without bound. Waiters start in arrival order (a long prompt is not starved by short ones). A
waiting request whose client cancels leaves the queue within `poll_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from specdec.errors import CapacityError, InvalidRequestError, SpecDecError
from specdec.kv_memory import DEFAULT_BLOCK_SIZE, blocks_for

POLL_S = 0.25  # how often a waiting request checks whether its client is still there


class CancelledWhileQueued(SpecDecError):
    """The client went away before its request got a slot."""


@dataclass
class _Waiter:
    blocks: int
    granted: asyncio.Future[None]


class Admission:
    """FIFO hand-over of sequence slots and KV blocks: a release starts the oldest waiters that now fit."""

    def __init__(self, capacity: int, max_waiting: int, timeout_s: float, poll_s: float = POLL_S,
                 kv_blocks: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        """`capacity`: live sequences; `kv_blocks` (None: no memory cap): the pool's blocks of `block_size` rows."""
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.kv_blocks = kv_blocks
        self.block_size = block_size
        self.running = 0
        self.blocks_reserved = 0
        self._waiters: deque[_Waiter] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def blocks_of(self, rows: int) -> int:
        return blocks_for(rows, self.block_size) if self.kv_blocks is not None else 0

    @contextlib.asynccontextmanager
    async def slot(self, is_cancelled: Callable[[], bool] = lambda: False, rows: int = 0) -> AsyncIterator[None]:
        """Hold a sequence slot and the KV blocks of `rows` rows for the body; raises CapacityError when they do
        not come in time, InvalidRequestError when `rows` exceed the whole pool."""
        blocks = self.blocks_of(rows)
        if self.kv_blocks is not None and blocks > self.kv_blocks:
            raise InvalidRequestError("max_tokens", f"prompt + max_tokens ({rows} tokens) need more KV memory than "
                                      f"the whole budget holds ({self.kv_blocks * self.block_size} tokens)")
        await self._acquire(is_cancelled, blocks)
        try:
            yield
        finally:
            self._release(blocks)

    def _fits(self, blocks: int) -> bool:
        return self.running < self.capacity and (
            self.kv_blocks is None or self.blocks_reserved + blocks <= self.kv_blocks)

    def _take(self, blocks: int) -> None:
        self.running += 1
        self.blocks_reserved += blocks

    async def _acquire(self, is_cancelled: Callable[[], bool], blocks: int) -> None:
        if not self._waiters and self._fits(blocks):
            self._take(blocks)
            return
        if self.waiting >= self.max_waiting:
            raise CapacityError(f"server busy: {self.running} generations hold {self._held()} and {self.waiting} "
                                f"requests already wait (limit {self.max_waiting}); retry later")
        waiter = _Waiter(blocks, asyncio.get_running_loop().create_future())
        self._waiters.append(waiter)
        deadline = time.monotonic() + self.timeout_s
        try:
            while not waiter.granted.done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CapacityError(f"server busy: no KV slot became free within {self.timeout_s:g} s "
                                        "(a sequence slot and the KV memory of prompt + max_tokens); retry later")
                if is_cancelled():
                    raise CancelledWhileQueued("the request was cancelled while waiting for a KV slot")
                await asyncio.wait({waiter.granted}, timeout=min(self.poll_s, left))  # never cancels `granted`
        except BaseException:
            if waiter.granted.done() and not waiter.granted.cancelled():
                self._release(blocks)  # the slot arrived as we gave up: pass it on
            else:
                waiter.granted.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
                self._start_waiters()  # it may have held back smaller requests behind it
            raise

    def _held(self) -> str:
        if self.kv_blocks is None:
            return "all KV slots"
        return f"{self.blocks_reserved} of {self.kv_blocks} KV blocks"

    def _release(self, blocks: int) -> None:
        self.running -= 1
        self.blocks_reserved -= blocks
        self._start_waiters()

    def _start_waiters(self) -> None:
        """Start the oldest waiters while the oldest fits (in order: a big request is not overtaken forever)."""
        while self._waiters:
            head = self._waiters[0]
            if head.granted.done():  # gave up; its own handler removes it
                self._waiters.popleft()
                continue
            if not self._fits(head.blocks):
                return
            self._waiters.popleft()
            self._take(head.blocks)
            head.granted.set_result(None)
