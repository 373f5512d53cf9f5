"""specdec.waves: concurrent sequences' target calls go out together; a lone one never waits; a straggler or an
ended sequence does not hold a wave for long; and through the generator, waves change no sequence's tokens."""

from __future__ import annotations

import asyncio
import random

from specdec.engines import TargetEngine
from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator
from specdec.inprocess import BatchingBackend
from specdec.runtime.torch_llama import TorchLlamaRuntime
from specdec.waves import WaveGate


def run_sequences(gate: WaveGate, count: int, iterations: int, live: list[int], think_s=lambda i: 0.0005,
                  call_s: float = 0.004) -> list[set[int]]:
    """`count` sequences each make `iterations` calls through `gate` (a call takes `call_s`; between calls a
    sequence thinks `think_s(i)`); returns the sets of sequences whose calls overlapped (the waves)."""
    waves: list[set[int]] = []
    current: set[int] = set()

    async def sequence(i: int) -> None:
        nonlocal current
        try:
            for _ in range(iterations):
                await gate.enter()
                if not current:
                    waves.append(current)
                current.add(i)
                await asyncio.sleep(call_s)
                gate.leave()
                if not gate.in_flight:
                    current = set()
                await asyncio.sleep(think_s(i))
        finally:
            live[0] -= 1
            gate.changed()

    async def main() -> None:
        await asyncio.gather(*(sequence(i) for i in range(count)))

    asyncio.run(main())
    return waves


def test_concurrent_calls_go_out_in_whole_waves():
    live = [8]
    rng = random.Random(3)
    gate = WaveGate(lambda: live[0], gap_s=0.01, max_wait_s=0.05)
    waves = run_sequences(gate, 8, 10, live, think_s=lambda i: rng.uniform(0.0, 0.003))
    assert len(waves) == 10 and all(wave == set(range(8)) for wave in waves)


def test_a_lone_sequence_never_waits():
    live = [1]
    gate = WaveGate(lambda: live[0], gap_s=10.0, max_wait_s=10.0)  # any wait would show as a hang
    waves = run_sequences(gate, 1, 20, live)
    assert len(waves) == 20


def test_a_straggler_holds_a_wave_at_most_max_wait():
    """Sequence 0 thinks far longer than the others: the others go without it after max_wait_s."""
    live = [4]
    gate = WaveGate(lambda: live[0], gap_s=0.005, max_wait_s=0.02)
    waves = run_sequences(gate, 4, 6, live, think_s=lambda i: 0.2 if i == 0 else 0.0)
    assert any(0 not in wave and len(wave) == 3 for wave in waves)


def test_an_ended_sequence_releases_the_wave_waiting_for_it():
    """Sequence 0 makes fewer calls: once it has ended, the others' waves do not wait for it (the gaps are long,
    so only `changed()` can release them promptly)."""
    live = [3]
    gate = WaveGate(lambda: live[0], gap_s=5.0, max_wait_s=5.0)
    finished: list[int] = []

    async def sequence(i: int, iterations: int) -> None:
        try:
            for _ in range(iterations):
                await gate.enter()
                await asyncio.sleep(0.001)
                gate.leave()
        finally:
            live[0] -= 1
            gate.changed()
            finished.append(i)

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(sequence(0, 1), sequence(1, 4), sequence(2, 4)), timeout=2.0)

    asyncio.run(main())
    assert finished[0] == 0 and sorted(finished) == [0, 1, 2]


def test_a_cancelled_waiter_leaves_no_place_behind():
    live = [2]
    gate = WaveGate(lambda: live[0], gap_s=5.0, max_wait_s=5.0)

    async def main() -> None:
        await gate.enter()  # a wave in flight
        waiter = asyncio.ensure_future(gate.enter())
        await asyncio.sleep(0.01)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        gate.leave()
        assert gate.in_flight == 0
        live[0] = 1
        await asyncio.wait_for(gate.enter(), timeout=1.0)  # alone again: at once
        gate.leave()

    asyncio.run(main())


def test_waves_batch_concurrent_generations_and_change_no_tokens(tiny_pair):
    """Six greedy generations at once through a batching backend: each equals its single-stream output, and the
    target serves them in whole waves (the first prefill goes alone, the gate being idle: that sequence stays one
    step ahead, so its first and last steps are the only ones not in a wave of six)."""
    target_dir, _ = tiny_pair
    prompts = [[1 + i, 5, 9 + i, 2, 7] for i in range(6)]

    def generate(prompt_list: list[list[int]], batches: list[int]) -> list[list[int]]:
        engine = TargetEngine(TorchLlamaRuntime(target_dir, num_slots=8, max_length=64), 60)
        backend = BatchingBackend(engine, on_batch=lambda model, requests: batches.append(
            sum(1 for request in requests if len(request.input_ids))))  # forwards, not the final END calls
        generator = SpeculativeGenerator(backend, 64)

        async def one(prompt: list[int], sequence_id: int) -> list[int]:
            tokens: list[int] = []
            async for update in generator.generate(GenerationRequest(prompt, 12), sequence_id, GenerationStats()):
                tokens += update.token_ids
            return tokens

        async def main() -> list[list[int]]:
            return list(await asyncio.gather(*(one(p, 10 + i) for i, p in enumerate(prompt_list))))

        return asyncio.run(main())

    alone = [generate([prompt], [])[0] for prompt in prompts]
    batches: list[int] = []
    together = generate(prompts, batches)
    assert together == alone
    forwards = [size for size in batches if size]
    assert sum(forwards) == 6 * 12 and forwards.count(6) >= 10, forwards
