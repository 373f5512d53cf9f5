"""Admission control (cap, bounded wait, clear rejection, no lost slot) and the stop check, without a server."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from specdec.admission import Admission, CancelledWhileQueued
from specdec.errors import CapacityError
from specdec.liveness import AbandonedGenerations, StopCheck, generation_deadline_s


def run(coro):
    return asyncio.run(coro)


def test_cap_queue_and_rejection():
    async def scenario():
        admission = Admission(capacity=2, max_waiting=1, timeout_s=5, poll_s=0.01)
        release = asyncio.Event()
        started: list[int] = []

        async def job(i: int) -> None:
            async with admission.slot():
                started.append(i)
                await release.wait()

        tasks = [asyncio.create_task(job(i)) for i in range(3)]
        await asyncio.sleep(0.05)
        assert started == [0, 1] and admission.running == 2 and admission.waiting == 1
        with pytest.raises(CapacityError, match="already wait"):
            async with admission.slot():
                pass
        release.set()
        await asyncio.gather(*tasks)
        assert started == [0, 1, 2] and admission.running == 0 and admission.waiting == 0

    run(scenario())


def test_wait_times_out_with_a_clear_error_and_loses_no_slot():
    async def scenario():
        admission = Admission(capacity=1, max_waiting=4, timeout_s=0.1, poll_s=0.02)
        async with admission.slot():
            began = time.monotonic()
            with pytest.raises(CapacityError, match="within 0.1 s"):
                async with admission.slot():
                    pass
            assert time.monotonic() - began < 1.0
        assert admission.running == 0 and admission.waiting == 0
        async with admission.slot():  # the slot is still there
            assert admission.running == 1

    run(scenario())


def test_cancelled_waiter_leaves_the_queue():
    async def scenario():
        admission = Admission(capacity=1, max_waiting=4, timeout_s=10, poll_s=0.01)
        cancelled = False
        async with admission.slot():
            waiter = asyncio.create_task(admission.slot(lambda: cancelled).__aenter__())
            await asyncio.sleep(0.03)
            assert admission.waiting == 1
            cancelled = True
            with pytest.raises(CancelledWhileQueued):
                await waiter
            assert admission.waiting == 0
        assert admission.running == 0

    run(scenario())


def test_task_cancelled_while_the_slot_is_handed_over_passes_it_on():
    async def scenario():
        admission = Admission(capacity=1, max_waiting=4, timeout_s=10, poll_s=0.01)
        holder = admission.slot()
        await holder.__aenter__()
        first = asyncio.create_task(admission.slot().__aenter__())
        second_cm = admission.slot()
        second = asyncio.create_task(second_cm.__aenter__())
        await asyncio.sleep(0.03)
        await holder.__aexit__(None, None, None)  # hands the slot to `first` ...
        first.cancel()  # ... which gives up before it runs: the slot must reach `second`
        await asyncio.wait_for(second, 1)
        assert admission.running == 1 and admission.waiting == 0
        await second_cm.__aexit__(None, None, None)
        assert admission.running == 0

    run(scenario())


def test_abandoned_marks_are_shared_through_the_filesystem(tmp_path: Path):
    writer, reader = AbandonedGenerations(tmp_path / "marks"), AbandonedGenerations(tmp_path / "marks")
    assert not reader.is_marked(42)
    writer.mark(42)
    writer.mark(0)  # "no generation": ignored
    assert reader.is_marked(42) and not reader.is_marked(0)
    reader.clear(42)
    assert not writer.is_marked(42)
    writer.mark(7)
    old = time.time() - 3600
    os.utime(tmp_path / "marks" / "7", (old, old))
    writer.mark(8)
    assert reader.sweep(max_age_s=60) == 1 and reader.is_marked(8)
    reader.remove_all()
    assert not (tmp_path / "marks").exists()


def test_stop_check_reports_the_first_reason(tmp_path: Path):
    now = [0.0]
    marks = AbandonedGenerations(tmp_path)
    cancelled = [False]
    check = StopCheck(lambda: cancelled[0], marks, 5, deadline_s=10.0, clock=lambda: now[0])
    assert not check()
    marks.mark(5)
    assert check() and check.reason == "abandoned"
    cancelled[0] = True
    assert check() and check.reason == "abandoned"  # the first reason sticks
    late = StopCheck(lambda: False, None, 6, deadline_s=10.0, clock=lambda: now[0])
    now[0] = 10.5
    assert late() and late.reason == "deadline"


@pytest.mark.parametrize(("limit_s", "timeout_us", "expected"),
                         [(600, 0, 600), (600, 2_000_000, 2.0), (0, 0, None), (0, 5_000_000, 5.0)])
def test_deadline_is_the_tighter_bound(limit_s, timeout_us, expected):
    assert generation_deadline_s(limit_s, timeout_us) == expected
