"""Waves: the target calls of concurrent sequences gathered and sent as one call, so one decoder execution
serves them.

Sent one by one, concurrent sequences' steps reach Triton's sequence batcher a few milliseconds apart, and it
forms the next batch while the decoder instance still runs the current one (its dynamic batcher prefetches one
payload): 16 sequences reached the target in batches of 5.9 on average. `WaveGate` holds a sequence's call while
a wave is in flight; once the wave is done it sends every waiting call together, as one `send` (the backend
packs them into one request, specdec.packing), when all generating sequences are waiting, or when no new call
has come for `gap_s`, or at the latest `max_wait_s` after the wave ended. A lone sequence never waits.

Streamed responses wait for the wave too (`responses_may_go`): a response is a blocking round trip from the
Python backend to the server, and the server takes the backend's messages in order, so 64 streams' responses
sent while the next wave forms delayed both (64 streams, gRPC: 18 ms from a wave's results to the next wave
against 6 unstreamed, and 27 ms more before the target saw it against 3): they go out once the next wave has
been sent, while the target computes it, or at the latest `RESPONSE_HOLD_S` after the results came back.

Only timing changes: which tokens a sequence generates does not depend on the waves (greedy output equals plain
decoding's, a seeded sampled request gives the same text on any load).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

WAVE_GAP_S = 0.003  # send the waiting calls when no other call came this long after the last one
WAVE_MAX_WAIT_S = 0.02  # ... and at the latest this long after the wave in flight ended
RESPONSES_AFTER_S = 0.002  # responses go out this long after a wave is sent (its request reaches the server first)
RESPONSE_HOLD_S = 0.03  # ... and at the latest this long after a wave's results came back

Call = TypeVar("Call")
Result = TypeVar("Result")


class WaveGate(Generic[Call, Result]):
    """Gathers the calls of concurrent sequences into waves (see the module docstring).

    `send` serves a wave: the results of its calls, in order. `generating` counts the sequences that may still
    call in this wave (the generator's live sequences); call `changed()` when it drops, so a wave waiting for a
    sequence that just ended goes at once."""

    def __init__(self, generating: Callable[[], int], send: Callable[[list[Call]], Awaitable[list[Result]]],
                 gap_s: float = WAVE_GAP_S, max_wait_s: float = WAVE_MAX_WAIT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.generating = generating
        self.send = send
        self.gap_s, self.max_wait_s = gap_s, max_wait_s
        self._clock = clock
        self._waiting: list[tuple[Call, asyncio.Future[tuple[Result, float]]]] = []
        self._in_flight = False
        self._idle_since = clock()  # when the last wave ended
        self._timer: asyncio.TimerHandle | None = None
        self._wave_task: asyncio.Task[None] | None = None
        self._responses_go = asyncio.Event()
        self._responses_go.set()
        self._hold_epoch = 0  # a timer that would let responses go is stale once this moved on

    @property
    def in_flight(self) -> bool:
        return self._in_flight

    async def call(self, item: Call) -> tuple[Result, float]:
        """`item`'s result once its wave has been served, and when (`clock`) the wave was sent. A caller
        cancelled while its wave is in flight leaves the wave to finish (its result is dropped)."""
        done: asyncio.Future[tuple[Result, float]] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, done))
        if not self._in_flight and len(self._waiting) == 1 and self.generating() <= 1:
            self._release()  # alone: at once
        else:
            self._schedule()
        try:
            return await done
        except asyncio.CancelledError:
            self._waiting = [(other, future) for other, future in self._waiting if future is not done]
            raise

    async def responses_may_go(self) -> None:
        """Returns when a streamed response can be sent without delaying the next wave (module docstring)."""
        await self._responses_go.wait()

    def _let_responses_go(self, after_s: float) -> None:
        self._hold_epoch += 1
        asyncio.get_running_loop().call_later(after_s, self._responses_may_go_now, self._hold_epoch)

    def _responses_may_go_now(self, epoch: int) -> None:
        if epoch == self._hold_epoch:
            self._responses_go.set()

    def changed(self) -> None:
        """The number of generating sequences changed."""
        self._schedule()

    def _schedule(self) -> None:
        if self._in_flight or not self._waiting:
            return
        if len(self._waiting) >= self.generating() or self._clock() - self._idle_since >= self.max_wait_s:
            self._release()
            return
        if self._timer is not None:
            self._timer.cancel()
        delay = min(self.gap_s, max(self.max_wait_s - (self._clock() - self._idle_since), 0.0))
        self._timer = asyncio.get_running_loop().call_later(delay, self._release)

    def _release(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        wave, self._waiting = [(item, done) for item, done in self._waiting if not done.done()], []
        if self._in_flight or not wave:
            self._waiting = wave
            return
        self._in_flight = True
        self._wave_task = asyncio.ensure_future(self._serve(wave))
        self._let_responses_go(RESPONSES_AFTER_S)

    async def _serve(self, wave: list[tuple[Call, asyncio.Future[tuple[Result, float]]]]) -> None:
        sent_at = self._clock()
        try:
            results = await self.send([item for item, _ in wave])
            self._responses_go.clear()  # until the next wave is out
            self._let_responses_go(RESPONSE_HOLD_S)
            for (_, done), result in zip(wave, results, strict=True):
                if not done.done():
                    done.set_result((result, sent_at))
        except BaseException as exc:  # the whole wave failed: each caller gets the error
            for _, done in wave:
                if not done.done():
                    done.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
            if not isinstance(exc, Exception):
                raise
        finally:
            self._in_flight = False
            self._idle_since = self._clock()
            self._schedule()
