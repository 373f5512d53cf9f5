"""The context buffer (specdec.runtime.context_buffer): batches of the same sequences reuse the last forward's
gathered context, and every forward gives the logits an exact gather gives, bit for bit, through joins,
partial waves, rollbacks, tree-row moves, releases and growth, with the graph writing its new rows into the
buffer itself (specdec.runtime.onnx_llama.graph_writing_in_place)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from specdec.runtime.base import ForwardItem  # noqa: E402
from specdec.runtime.context_buffer import WIDTH_STEP, ContextBuffer, buffer_width  # noqa: E402
from specdec.runtime.onnx_llama import OnnxLlamaRuntime  # noqa: E402

TARGET = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "pair_12m" / "target"


def empty_buffer(columns: list[int | None], width: int = 64) -> ContextBuffer:
    shape = (2, 1, len(columns), width, 4)
    return ContextBuffer(list(columns), np.zeros(shape, np.float32), np.zeros(shape, np.float32))


def test_a_buffer_places_its_sequences_newcomers_and_fillers():
    buffer = empty_buffer([4, 7, 9])
    held = {4: 10, 7: 10, 9: 10, 3: 0, 5: 0, 11: 0}.__getitem__
    assert buffer.place([9, 4, 7], 64, 1, held, max_fillers=0) == [2, 0, 1]
    assert buffer.place([4, 7, 9], 65, 1, held, max_fillers=3) is None  # wider than the buffer
    assert buffer.place([4, 7], 10, 1, held, max_fillers=0) is None and buffer.is_subset([4, 7])  # too many fillers
    assert buffer.place([4, 7], 10, 1, held, max_fillers=1) == [0, 1]  # slot 9 sits out: its column a filler
    assert buffer.fillers([0, 1]) == [2]
    # A filler 60 wide would write slot 9's rows: slot 9 loses its column (gathered when it next joins).
    assert buffer.place([4, 7], 10, 60, held, max_fillers=1) == [0, 1] and buffer.columns == [4, 7, None]
    assert buffer.place([9, 4, 7], 64, 1, held, max_fillers=0) == [2, 0, 1] and buffer.stale == {2}
    buffer.stale.clear()
    assert buffer.place([4, 7, 9, 11], 10, 1, held, max_fillers=3) is None and not buffer.is_subset([4, 7, 9, 11])
    buffer.forget(7)
    assert buffer.place([4, 9, 3, 5], 10, 1, held, max_fillers=3) is None  # two newcomers, one dead column
    assert buffer.columns == [4, None, 9]  # unchanged by a refusal
    assert buffer.place([3, 9, 4], 10, 1, held, max_fillers=0) == [1, 2, 0]
    assert buffer.columns == [4, 3, 9] and buffer.stale == {1}  # the newcomer's column is gathered before use
    assert buffer.place([3, 5, 4], 10, 1, held, max_fillers=0) == [1, 2, 0]  # 5 takes absent 9's column
    assert buffer.columns == [4, 3, 5] and buffer.stale == {1, 2}
    assert buffer_width(1) == WIDTH_STEP and buffer_width(WIDTH_STEP) == 2 * WIDTH_STEP


def test_writes_land_in_their_columns_below_the_width():
    buffer = empty_buffer([4, 7], width=8)
    new = np.arange(2 * 1 * 3 * 4, dtype=np.float32).reshape(2, 1, 3, 4) + 1
    buffer.write(np.array([7, 4, 5]), np.array([3, 9, 0]), new, -new)  # slot 5 has no column; row 9 >= width
    assert np.array_equal(buffer.keys[:, :, 1, 3], new[:, :, 0])
    assert np.array_equal(buffer.values[:, :, 1, 3], -new[:, :, 0])
    assert np.count_nonzero(buffer.keys) == new[:, :, 0].size


class CountingRuntime(OnnxLlamaRuntime):
    """Counts the slot-rows it gathers from the paged cache."""

    gathered = 0

    def _gather_context(self, slots, rows):
        self.gathered += len(slots) * rows
        return super()._gather_context(slots, rows)


def test_forwards_through_the_buffer_equal_exact_gathers_bit_for_bit(tmp_path):
    kept = CountingRuntime(TARGET, num_slots=4, max_length=256, num_threads=1, engine_dir=tmp_path)
    exact = OnnxLlamaRuntime(TARGET, num_slots=4, max_length=256, num_threads=1, engine_dir=tmp_path)
    exact.keeps_context = False
    exact.written_context = {}  # the ScatterND copies each layer's context, as without the IOBinding
    assert len(kept.written_context) == 2 * kept.spec.num_layers  # every layer's keys and values in place
    rng = np.random.default_rng(3)
    lengths = {0: 0, 1: 0, 2: 0, 3: 0}

    def both(items: list[ForwardItem]) -> None:
        got, want = kept.forward(items), exact.forward(items)
        for item, g, w in zip(items, got, want, strict=True):
            assert np.array_equal(g, w), f"slot {item.slot}: max |diff| {np.abs(g - w).max()}"

    def step(slots: list[int], width: int = 1) -> None:
        items = [ForwardItem(s, lengths[s], rng.integers(3, kept.vocab_size, width), num_logits=width) for s in slots]
        both(items)
        for s in slots:
            lengths[s] += width

    def rollback(slot: int, rows: int) -> None:
        lengths[slot] = rows
        for runtime in (kept, exact):
            runtime.resize_rows(slot, rows)

    for slot, prompt in ((0, 23), (1, 9), (2, 40)):
        step([slot], prompt)
    kept.gathered = 0
    for _ in range(4):
        step([0, 1, 2])
    assert kept._context_buffer is not None and kept._context_buffer.columns == [0, 1, 2]
    assert kept.gathered == 3 * buffer_width(41)  # one gather, then the buffer is reused
    step([2, 0, 1])  # another order: the same buffer, the items permuted
    gathered = kept.gathered
    step([0, 2])  # a partial wave: slot 1's column runs a filler (no gather), the buffer kept in step
    assert kept.gathered == gathered and kept._context_buffer.columns == [0, 1, 2]
    step([0, 2], width=3)  # the filler's rows (past slot 1's) as wide as the batch
    step([2])  # a lone sequence gathers its own context
    step([0, 1, 2], width=4)  # a verification
    rollback(0, lengths[0] - 3)  # three drafts rejected: rows past the length are stale, and masked
    step([0, 1, 2])
    for runtime in (kept, exact):  # a tree path committed: rows of slot 2 move
        runtime.move_rows(2, np.array([lengths[2] - 1]), lengths[2] - 2)
    rollback(2, lengths[2] - 1)
    step([0, 1, 2])
    for runtime in (kept, exact):  # slot 1 finishes; a new sequence joins in slot 3
        runtime.release(1)
    lengths[1] = 0
    step([3], 17)
    gathered = kept.gathered
    step([0, 3, 2])
    assert kept._context_buffer.columns == [0, 3, 2]
    assert kept.gathered - gathered == kept._context_buffer.width  # only the newcomer's column
    step([1], 12)  # another sequence joins in slot 1 ...
    step([0, 1, 2])  # ... and takes the column of slot 3, which sits this wave out
    assert kept._context_buffer.columns == [0, 1, 2]
    step([0, 1, 2, 3])  # slot 3 back with no column free: a new buffer
    step([0, 3, 2])  # slot 1 sits out: a filler in its column
    for runtime in (kept, exact):  # slot 1 finishes: its column dead, run as a filler
        runtime.release(1)
    width = kept._context_buffer.width
    while lengths[2] + 1 <= width:  # the key rows fit the buffer
        step([0, 3, 2])
    assert kept._context_buffer.width == width
    step([0, 3, 2])  # past the width: a wider buffer
    assert kept._context_buffer.width == buffer_width(width + 1)
    width = kept._context_buffer.width
    pad = width - lengths[2] + 1  # a chunk this wide from slots 0 and 3: its filler would write slot 2's rows
    assert max(lengths[0], lengths[3]) + pad <= width
    step([0, 3], width=pad)
    assert kept._context_buffer.columns == [0, 3, None]  # slot 2 lost its column, not the batch its buffer
    gathered = kept.gathered
    step([0, 3, 2])  # slot 2 back: its column gathered again, alone
    assert kept._context_buffer.columns == [0, 3, 2] and kept.gathered - gathered == width
    for slot in (0, 3, 2):  # the wave ends: the buffer's memory goes back with its last sequence
        assert kept._context_buffer is not None
        kept.release(slot)
    assert kept._context_buffer is None


def test_a_prompt_chunk_beside_decode_steps_runs_as_its_own_forward(tmp_path):
    """Items of very different widths run as separate forwards (layout.group_by_width), with the logits one
    forward of everything gives, bit for bit."""
    from specdec.runtime.layout import group_by_width

    runtime = CountingRuntime(TARGET, num_slots=4, max_length=128, num_threads=1, engine_dir=tmp_path)
    rng = np.random.default_rng(5)
    for slot in range(3):
        runtime.forward([ForwardItem(slot, 0, rng.integers(3, runtime.vocab_size, 20))])
    items = [ForwardItem(0, 20, rng.integers(3, runtime.vocab_size, 1)),
             ForwardItem(3, 0, rng.integers(3, runtime.vocab_size, 30), num_logits=2),  # a prompt chunk
             ForwardItem(1, 20, rng.integers(3, runtime.vocab_size, 5), num_logits=5),  # a verification
             ForwardItem(2, 20, rng.integers(3, runtime.vocab_size, 1))]
    assert group_by_width(items) == [[1], [0, 2, 3]]
    forwards = []
    batch = runtime._forward_batch
    runtime._forward_batch = lambda part: forwards.append(len(part)) or batch(part)
    got = runtime.forward(items)
    assert sorted(forwards) == [1, 3]
    for slot in range(4):
        runtime.resize_rows(slot, 0 if slot == 3 else 20)
    runtime._grow_for(items)
    together = batch(items)  # all four in one padded forward
    for g, w in zip(got, together, strict=True):
        assert np.array_equal(g, w.logits)


def test_a_few_sequences_beside_the_wave_leave_its_buffer_in_place(tmp_path):
    """A small batch with a sequence the buffer does not hold (a newcomer's first steps beside a running wave)
    gathers its own context and keeps the wave's buffer; logits as from exact gathers, bit for bit."""
    kept = CountingRuntime(TARGET, num_slots=6, max_length=256, num_threads=1, engine_dir=tmp_path)
    exact = OnnxLlamaRuntime(TARGET, num_slots=6, max_length=256, num_threads=1, engine_dir=tmp_path)
    exact.keeps_context = False
    rng = np.random.default_rng(5)
    lengths = dict.fromkeys(range(6), 0)

    def step(slots: list[int], width: int = 1) -> None:
        items = [ForwardItem(s, lengths[s], rng.integers(3, kept.vocab_size, width), num_logits=width) for s in slots]
        for item, g, w in zip(items, kept.forward(items), exact.forward(items), strict=True):
            assert np.array_equal(g, w), f"slot {item.slot}: max |diff| {np.abs(g - w).max()}"
        for s in slots:
            lengths[s] += width

    for slot in range(5):
        step([slot], 5 + 3 * slot)
    wave = [0, 1, 2, 3, 4]
    step(wave)
    buffer = kept._context_buffer
    assert buffer is not None and buffer.columns == wave
    step([5], 7)  # a newcomer's prompt
    gathered = kept.gathered
    step([0, 5])  # its first step beside one of the wave's sequences: two columns gathered, the buffer kept
    assert kept._context_buffer is buffer and buffer.columns == wave
    assert kept.gathered - gathered == 2 * max(lengths[0], lengths[5])
    step(wave)  # the wave again: its buffer, slot 0's new row mirrored into it
    assert kept._context_buffer is buffer
    step([*wave, 5])  # the newcomer joins the wave: no column free, a new buffer
    assert kept._context_buffer.columns == [*wave, 5]
