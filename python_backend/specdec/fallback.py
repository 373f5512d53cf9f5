"""Automatic fallback to plain decoding when speculation stops paying, with periodic probes to recover.

One monitor per task profile. It keeps the draft tokens proposed and accepted over a sliding window; when
the window's acceptance rate stays under the threshold (the window must span `window_s` of observation
and hold enough evidence), the profile falls back: its requests decode plainly, except probe iterations
granted every `probe_interval_s`. Probes keep feeding the window; when the rate climbs back over the
threshold, speculation resumes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from specdec.config import FallbackConfig

log = logging.getLogger(__name__)
PROBE_ITERATIONS = 8


class FallbackMonitor:
    def __init__(self, name: str, config: FallbackConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.config = config
        self._clock = clock
        self._events: deque[tuple[float, int, int]] = deque()
        self._since = clock()  # start of the current observation period
        self.active = False
        self._last_probe = float("-inf")
        self._probe_left = 0
        self.transitions = 0

    def _prune(self, now: float) -> None:
        while self._events and now - self._events[0][0] > self.config.window_s:
            self._events.popleft()

    def window_rate(self) -> tuple[float, int]:
        """(acceptance rate, draft tokens) over the window."""
        self._prune(self._clock())
        proposed = sum(e[1] for e in self._events)
        accepted = sum(e[2] for e in self._events)
        return (accepted / proposed if proposed else 0.0), proposed

    def record(self, proposed: int, accepted: int) -> None:
        now = self._clock()
        self._events.append((now, proposed, accepted))
        self._prune(now)
        rate, tokens = self.window_rate()
        enough = tokens >= self.config.min_draft_tokens
        if not self.active and enough and now - self._since >= self.config.window_s and \
                rate < self.config.min_acceptance_rate:
            self._switch(True, now, rate)
        elif self.active and enough and rate >= self.config.min_acceptance_rate:
            self._switch(False, now, rate)

    def _switch(self, active: bool, now: float, rate: float) -> None:
        self.active = active
        self.transitions += 1
        self._since = now
        if active:
            log.warning("task %s: acceptance %.2f < %.2f over %.0f s: falling back to plain decoding",
                        self.name, rate, self.config.min_acceptance_rate, self.config.window_s)
            # Probes must start from fresh evidence, not the window that triggered the fallback.
            self._events.clear()
        else:
            log.warning("task %s: acceptance recovered to %.2f: speculation resumes", self.name, rate)

    def allow_speculation(self) -> bool:
        """Whether this iteration may speculate (always, unless fallen back and not probing)."""
        if not self.active:
            return True
        if self._probe_left > 0:
            self._probe_left -= 1
            return True
        now = self._clock()
        if now - self._last_probe >= self.config.probe_interval_s:
            self._last_probe = now
            self._probe_left = PROBE_ITERATIONS - 1
            return True
        return False
