"""Waves: the target calls of concurrent sequences released together, so that one decoder execution serves them.

Triton's sequence batcher forms the next batch while the decoder instance still runs the current one (its
dynamic batcher prefetches one payload), so sequences whose steps come back a few milliseconds apart settle into
alternating small batches: 16 sequences reached the target in batches of 5.9 on average. `WaveGate` holds a
sequence's target call while a wave of calls is in flight; once the wave is done it releases every waiting call
at once, when all generating sequences are waiting, or when no new call has come for `gap_s`, or at the latest
`max_wait_s` after the wave ended. A lone sequence never waits.

Only timing changes: which tokens a sequence generates does not depend on the waves (greedy output equals plain
decoding's, a seeded sampled request gives the same text on any load).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

WAVE_GAP_S = 0.003  # release the waiting calls when no other call came this long after the last one
WAVE_MAX_WAIT_S = 0.02  # ... and at the latest this long after the wave in flight ended


class WaveGate:
    """Gathers the calls of concurrent sequences into waves (see the module docstring).

    `generating` counts the sequences that may still call in this wave (the generator's live sequences); call
    `changed()` when it drops, so a wave waiting for a sequence that just ended is released."""

    def __init__(self, generating: Callable[[], int], gap_s: float = WAVE_GAP_S,
                 max_wait_s: float = WAVE_MAX_WAIT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.generating = generating
        self.gap_s, self.max_wait_s = gap_s, max_wait_s
        self._clock = clock
        self._waiting: list[asyncio.Future[None]] = []
        self._in_flight = 0
        self._idle_since = clock()  # when the last wave ended
        self._timer: asyncio.TimerHandle | None = None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def enter(self) -> None:
        """Wait for this call's wave; every `enter` that returns must be paired with a `leave`."""
        if not self._in_flight and not self._waiting and self.generating() <= 1:
            self._in_flight += 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        self._schedule()
        try:
            await turn
        except asyncio.CancelledError:
            if turn in self._waiting:
                self._waiting.remove(turn)
            elif turn.done() and not turn.cancelled():
                self.leave()  # released together with its wave, then cancelled: give its place back
            raise

    def leave(self) -> None:
        self._in_flight -= 1
        if not self._in_flight:
            self._idle_since = self._clock()
        self._schedule()

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
        if self._in_flight:
            return
        wave, self._waiting = [turn for turn in self._waiting if not turn.done()], []
        self._in_flight += len(wave)
        for turn in wave:
            turn.set_result(None)
