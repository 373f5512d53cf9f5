"""Should a running generation stop? Client cancellation, an abandoned ensemble request, or its deadline.

Cancelling a request to `speculative_decoding` directly reaches the model (`is_cancelled()` of its response
sender). Through an ensemble it does not on Triton 2.51: the running step is never told. What does happen is
that every ensemble step created after the cancellation is created cancelled, so `postprocessing` (which has
no dynamic batcher that would drop such a request unseen) sees `is_cancelled()` on the next chunk of the
generation. It then marks the generation abandoned in `AbandonedGenerations`, a directory on tmpfs that the
model processes of one server share, and the generation loop checks the mark every iteration. A deadline
bounds what nothing else can see (a non-streaming request through the ensemble has no next chunk).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

SHM_DIR = Path("/dev/shm")
ABANDONED_PREFIX = "specdec_abandoned_"
ORPHAN_MARK_AGE_S = 60.0  # a mark this old belongs to a generation that already ended (a live one reads it at once)


def abandoned_dir(server_pid: int) -> Path:
    """The marks directory of the tritonserver with this pid (model processes are its children)."""
    root = SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())
    return root / f"{ABANDONED_PREFIX}{server_pid}"


class AbandonedGenerations:
    """Empty files named by generation id: a mark is a create, a check is a stat (microseconds on tmpfs)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    @classmethod
    def for_this_server(cls) -> AbandonedGenerations:
        """The set shared by every model process of the server that started this process."""
        return cls(abandoned_dir(os.getppid()))

    def _path(self, generation_id: int) -> Path:
        return self.root / str(int(generation_id))

    def mark(self, generation_id: int) -> None:
        if generation_id <= 0:
            return
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._path(generation_id).touch()

    def is_marked(self, generation_id: int) -> bool:
        return generation_id > 0 and self._path(generation_id).exists()

    def clear(self, generation_id: int) -> None:
        with contextlib.suppress(OSError):
            self._path(generation_id).unlink()

    def sweep(self, max_age_s: float = ORPHAN_MARK_AGE_S) -> int:
        """Remove marks older than `max_age_s` (a chunk marked after its generation ended); returns how many."""
        if not self.root.is_dir():
            return 0
        removed = 0
        cutoff = time.time() - max_age_s
        for path in self.root.iterdir():
            with contextlib.suppress(OSError):
                if path.stat().st_mtime < cutoff:
                    path.unlink()
                    removed += 1
        return removed

    def remove_all(self) -> None:
        """Delete the directory (at model unload)."""
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            with contextlib.suppress(OSError):
                path.unlink()
        with contextlib.suppress(OSError):
            self.root.rmdir()


class StopCheck:
    """The `is_cancelled` callable the generation loop polls once per iteration; `reason` says why it fired."""

    def __init__(self, cancelled: Callable[[], bool], abandoned: AbandonedGenerations | None, generation_id: int,
                 deadline_s: float | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._cancelled = cancelled
        self._abandoned = abandoned
        self.generation_id = generation_id
        self._clock = clock
        self.started = clock()
        self.deadline_s = deadline_s
        self.reason: str | None = None  # "cancelled" | "abandoned" | "deadline"

    def __call__(self) -> bool:
        if self.reason is None:
            if self._cancelled():
                self.reason = "cancelled"
            elif self._abandoned is not None and self._abandoned.is_marked(self.generation_id):
                self.reason = "abandoned"
            elif self.deadline_s is not None and self.elapsed_s() > self.deadline_s:
                self.reason = "deadline"
        return self.reason is not None

    def elapsed_s(self) -> float:
        return self._clock() - self.started


def generation_deadline_s(max_generation_s: float, request_timeout_us: int) -> float | None:
    """The tighter of the server's limit and the request's Triton `timeout` (microseconds, 0 = none)."""
    limits = [s for s in (max_generation_s if max_generation_s > 0 else None,
                          request_timeout_us / 1e6 if request_timeout_us > 0 else None) if s is not None]
    return min(limits) if limits else None
