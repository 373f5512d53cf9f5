"""KV-slot bookkeeping: which sequence owns which cache slot, and for how long.

A slot is taken at a sequence's START, looked up on every step, and freed at END, or when the sequence has
been idle longer than `idle_timeout_s` (a client that vanished must not hold a slot forever). A slot is an
index into the runtime's block tables (specdec.kv_memory): `on_release` gives its KV blocks back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from specdec.errors import CapacityError, SequenceStateError


@dataclass
class SlotEntry:
    slot: int
    written_length: int
    last_used: float


class SlotTable:
    def __init__(self, num_slots: int, idle_timeout_s: float, clock: Callable[[], float] = time.monotonic,
                 on_release: Callable[[int], None] = lambda slot: None) -> None:
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        self.num_slots = num_slots
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        self._on_release = on_release
        self._free = list(range(num_slots - 1, -1, -1))
        self._entries: dict[int, SlotEntry] = {}

    @property
    def in_use(self) -> int:
        return len(self._entries)

    def acquire(self, sequence_id: int) -> SlotEntry:
        """The slot of a starting sequence (a repeated START restarts the sequence in its slot)."""
        entry = self._entries.get(sequence_id)
        if entry is None:
            if not self._free:
                self.evict_idle()
            if not self._free:
                raise CapacityError(f"all {self.num_slots} KV slots are in use")
            entry = SlotEntry(slot=self._free.pop(), written_length=0, last_used=self._clock())
            self._entries[sequence_id] = entry
        entry.written_length = 0
        entry.last_used = self._clock()
        return entry

    def lookup(self, sequence_id: int) -> SlotEntry:
        entry = self._entries.get(sequence_id)
        if entry is None:
            raise SequenceStateError(f"sequence {sequence_id} has no KV slot (never started, ended or expired)")
        entry.last_used = self._clock()
        return entry

    def release(self, sequence_id: int) -> bool:
        entry = self._entries.pop(sequence_id, None)
        if entry is None:
            return False
        self._on_release(entry.slot)
        self._free.append(entry.slot)
        return True

    def evict_idle(self) -> list[int]:
        """Free the slots of sequences idle for longer than the timeout; returns their ids."""
        now = self._clock()
        expired = [sid for sid, e in self._entries.items() if now - e.last_used > self.idle_timeout_s]
        for sid in expired:
            self.release(sid)
        return expired
