"""The gathered KV context of the last batch, kept between forwards (numpy runtimes).

A step graph reads each sequence's past KV as one contiguous input per layer, [kv_heads, batch, past,
head_dim], while the paged cache keeps a sequence's rows in blocks spread over the pool. Gathering them is a
copy of every cached row of the batch per forward: at 16 sequences of 200 tokens, 147 MB and ~20 ms of a
~90 ms step on the 2-core CPU (memory-bound; a second thread does not help). Under load the same sequences
step together forward after forward (waves), so the gathered copy of one forward is the next one's input
but for the rows the forward wrote. This buffer keeps it: a column per sequence, `width` rows per column
(the graph reads `width` key rows, writes the new tokens' keys at their own rows and masks every row past a
sequence's length, so its logits are the same bit for bit as from an exact gather: step_graph),
updated in place with every forward's new rows, re-gathered per column only when something else changed a
column's slot (a move of tree rows, a release, a forward that did not keep the column in step).

The buffer serves a batch that covers most of its columns: the batch's sequences in their columns,
sequences that joined in dead columns (a finished sequence's column goes to the next one) or in the columns of
live sequences that sit this forward out (those lose their column, and get one back when they next join),
and every column left over run as a *filler*: a one-token item whose outputs are dropped and whose key rows
go to its column's dead rows only (at `width - batch width`, past every row the column's sequence holds), so a
sequence that is late for a wave keeps its column without a gather. A filler costs the forward one row of
compute, a gathered column a copy of its context: a batch with more fillers than half its own items (a small
partial wave) is gathered the old way and leaves the buffer as it is; a batch the buffer cannot place (wider
than `width`, more newcomers than free columns) gathers a new buffer. Its memory is the size of one gathered
batch, which the old way allocated and freed at every forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

WIDTH_STEP = 32  # rows a buffer is sized in: a new buffer every WIDTH_STEP decode steps at most


def buffer_width(rows: int) -> int:
    """Rows per column of a buffer made for a batch that reads `rows` key rows: room for more steps, rounded
    up to WIDTH_STEP."""
    return (rows // WIDTH_STEP + 1) * WIDTH_STEP


@dataclass
class ContextBuffer:
    """Gathered context rows of the slots in `columns` (None: a released slot's column, free for a newcomer).

    `keys` and `values`: [layers, kv_heads, columns, width, head_dim]; `stale`: columns to re-gather before
    the next use."""

    columns: list[int | None]
    keys: np.ndarray
    values: np.ndarray
    stale: set[int] = field(default_factory=set)

    @property
    def width(self) -> int:
        return int(self.keys.shape[3])

    @property
    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.values.nbytes)

    @property
    def live_columns(self) -> int:
        """Columns held by a live sequence."""
        return sum(slot is not None for slot in self.columns)

    def column_of(self, slot: int) -> int | None:
        try:
            return self.columns.index(slot)
        except ValueError:
            return None

    def place(self, slots: list[int], rows: int, pad: int, rows_held: Callable[[int], int],
              max_fillers: int) -> list[int] | None:
        """The column of each of `slots` if this buffer can serve them as one batch reading `rows` key rows,
        `pad` new tokens wide (the batch's widest item), with the other columns run as (at most `max_fillers`)
        fillers; else None.
        Newcomers take dead columns, then the columns of live sequences absent from the batch (which become
        stale, theirs forgotten). A filler over a live sequence's column writes rows `width - pad ..`: a
        sequence that holds more rows (`rows_held`) loses its column (it is gathered again when it next joins,
        one column, where refusing gathered the whole batch). Does not change the buffer when it returns None."""
        if rows > self.width or len(set(slots)) != len(slots) or len(slots) > len(self.columns):
            return None
        if len(self.columns) - len(slots) > max_fillers:
            return None
        live = {slot: col for col, slot in enumerate(self.columns) if slot is not None}
        wanted = set(slots)
        newcomers = [slot for slot in slots if slot not in live]
        free = [col for col, slot in enumerate(self.columns) if slot is None]
        absent = [col for col, slot in enumerate(self.columns) if slot is not None and slot not in wanted]
        taken = (free + absent)[: len(newcomers)]
        if len(taken) < len(newcomers):
            return None
        fillers = set(free + absent) - set(taken)
        for col in fillers:
            if self.columns[col] is not None and rows_held(self.columns[col]) > self.width - pad:
                live.pop(self.columns[col])
                self.columns[col] = None
                self.stale.discard(col)
        for slot, col in zip(newcomers, taken, strict=True):
            live.pop(self.columns[col], None)
            self.columns[col] = slot
            self.stale.add(col)
        live.update(zip(newcomers, taken, strict=True))
        return [live[slot] for slot in slots]

    def fillers(self, columns: list[int]) -> list[int]:
        """The columns a batch placed in `columns` leaves to fillers."""
        used = set(columns)
        return [col for col in range(len(self.columns)) if col not in used]

    def is_subset(self, slots: list[int]) -> bool:
        """True when every one of `slots` has a live column and some live column is not among them."""
        live = {slot for slot in self.columns if slot is not None}
        return set(slots) < live

    def forget(self, slot: int) -> None:
        """`slot` was released: its column is free for the next sequence that joins."""
        col = self.column_of(slot)
        if col is not None:
            self.columns[col] = None
            self.stale.discard(col)

    def invalidate(self, slot: int) -> None:
        """`slot`'s rows changed outside the buffer: re-gather its column before the next use."""
        col = self.column_of(slot)
        if col is not None:
            self.stale.add(col)

    def write(self, slots: np.ndarray, rows: np.ndarray, new_keys: np.ndarray, new_values: np.ndarray) -> None:
        """Mirror a forward's new rows (logical `rows` of `slots`; new_* [layers, kv_heads, n, head_dim]) into
        the columns of those slots; rows at or past `width` are not kept (a later batch that needs them
        gathers a wider buffer)."""
        col_of = {slot: col for col, slot in enumerate(self.columns) if slot is not None}
        cols = np.array([col_of.get(int(slot), -1) for slot in slots], dtype=np.int64)
        keep = (cols >= 0) & (rows < self.width)
        if not keep.any():
            return
        cols, rows = cols[keep], rows[keep]
        self.keys[:, :, cols, rows] = new_keys[:, :, keep]
        self.values[:, :, cols, rows] = new_values[:, :, keep]
