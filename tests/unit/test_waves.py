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


def recording_gate(generating, waves: list[list[int]], call_s: float = 0.004, **timing) -> WaveGate[int, int]:
    """A gate whose `send` records each wave (its callers' ids), takes `call_s`, and answers each id doubled."""

    async def send(items: list[int]) -> list[int]:
        waves.append(list(items))
        await asyncio.sleep(call_s)
        return [2 * item for item in items]

    return WaveGate(generating, send, **timing)


def run_sequences(count: int, iterations: int, think_s=lambda i: 0.0005, **timing) -> list[set[int]]:
    """`count` sequences each make `iterations` calls through a gate (between calls a sequence thinks
    `think_s(i)`); returns the waves, as sets of the sequences in each."""
    live = [count]
    waves: list[list[int]] = []
    gate = recording_gate(lambda: live[0], waves, **timing)

    async def sequence(i: int) -> None:
        try:
            for _ in range(iterations):
                result, _sent_at = await gate.call(i)
                assert result == 2 * i
                await asyncio.sleep(think_s(i))
        finally:
            live[0] -= 1
            gate.changed()

    async def main() -> None:
        await asyncio.gather(*(sequence(i) for i in range(count)))

    asyncio.run(main())
    return [set(wave) for wave in waves]


def test_concurrent_calls_go_out_in_whole_waves():
    rng = random.Random(3)
    waves = run_sequences(8, 10, think_s=lambda i: rng.uniform(0.0, 0.003), gap_s=0.01, max_wait_s=0.05)
    assert len(waves) == 10 and all(wave == set(range(8)) for wave in waves)


def test_a_lone_sequence_never_waits():
    waves = run_sequences(1, 20, gap_s=10.0, max_wait_s=10.0)  # any wait would show as a hang
    assert len(waves) == 20


def test_a_straggler_holds_a_wave_at_most_max_wait():
    """Sequence 0 thinks far longer than the others: the others go without it after max_wait_s."""
    waves = run_sequences(4, 6, think_s=lambda i: 0.2 if i == 0 else 0.0, gap_s=0.005, max_wait_s=0.02)
    assert any(0 not in wave and len(wave) == 3 for wave in waves)


def test_an_ended_sequence_releases_the_wave_waiting_for_it():
    """Sequence 0 makes fewer calls: once it has ended, the others' waves do not wait for it (the gaps are long,
    so only `changed()` can release them promptly)."""
    live = [3]
    gate = recording_gate(lambda: live[0], [], call_s=0.001, gap_s=5.0, max_wait_s=5.0)
    finished: list[int] = []

    async def sequence(i: int, iterations: int) -> None:
        try:
            for _ in range(iterations):
                await gate.call(i)
        finally:
            live[0] -= 1
            gate.changed()
            finished.append(i)

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(sequence(0, 1), sequence(1, 4), sequence(2, 4)), timeout=2.0)

    asyncio.run(main())
    assert finished[0] == 0 and sorted(finished) == [0, 1, 2]


def test_a_cancelled_caller_leaves_no_place_behind():
    """A caller cancelled while waiting is not sent; one cancelled while its wave is in flight lets the wave
    finish; alone again, a call goes at once."""
    live = [3]
    waves: list[list[int]] = []
    gate = recording_gate(lambda: live[0], waves, call_s=0.05, gap_s=5.0, max_wait_s=5.0)

    async def main() -> None:
        in_flight = asyncio.ensure_future(gate.call(1))
        await asyncio.sleep(0)
        live[0] = 1  # the gate sends alone calls at once only when one sequence generates: force the wave out
        gate.changed()
        await asyncio.sleep(0.01)
        assert gate.in_flight
        waiting = asyncio.ensure_future(gate.call(2))
        await asyncio.sleep(0.01)
        waiting.cancel()
        in_flight.cancel()
        await asyncio.gather(waiting, in_flight, return_exceptions=True)
        await asyncio.sleep(0.06)  # the wave in flight ends
        assert not gate.in_flight
        result, _sent_at = await asyncio.wait_for(gate.call(3), timeout=1.0)
        assert result == 6

    asyncio.run(main())
    assert waves == [[1], [3]]


def test_a_failed_wave_fails_each_of_its_calls_and_the_next_wave_goes():
    live = [2]
    calls = []

    async def send(items: list[int]) -> list[int]:
        calls.append(items)
        if len(calls) == 1:
            raise RuntimeError("decoder gone")
        return items

    gate: WaveGate[int, int] = WaveGate(lambda: live[0], send, gap_s=0.001, max_wait_s=0.01)

    async def main() -> None:
        outcomes = await asyncio.gather(gate.call(1), gate.call(2), return_exceptions=True)
        assert all(isinstance(outcome, RuntimeError) for outcome in outcomes)
        results = await asyncio.gather(gate.call(3), gate.call(4))
        assert [result for result, _ in results] == [3, 4]

    asyncio.run(main())
    assert calls == [[1, 2], [3, 4]]


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


def test_streamed_responses_wait_until_the_next_wave_is_out():
    """A response queued when a wave's results come back goes out only after the next wave was sent (its
    request first at the server), or after RESPONSE_HOLD_S when no wave comes."""
    from specdec.waves import RESPONSE_HOLD_S, RESPONSES_AFTER_S

    events: list[tuple[str, float]] = []
    live = [2]

    async def send(items: list[int]) -> list[int]:
        events.append(("wave", asyncio.get_running_loop().time()))
        await asyncio.sleep(0.02)
        return items

    gate = WaveGate(lambda: live[0], send, gap_s=0.05, max_wait_s=0.2)

    async def responder(name: str) -> None:
        await gate.responses_may_go()
        events.append((name, asyncio.get_running_loop().time()))

    async def main() -> None:
        await gate.responses_may_go()  # before any wave: at once
        await asyncio.gather(gate.call(0), gate.call(1))  # a wave of two; its results are back
        sent = asyncio.ensure_future(responder("response"))
        await asyncio.sleep(0.01)  # the sequences think: the response is held
        assert not sent.done()
        await asyncio.gather(gate.call(0), gate.call(1), sent)
        live[0] = 0
        await responder("late")  # no next wave: held at most RESPONSE_HOLD_S

    asyncio.run(main())
    (_, second_wave), (_, response), (_, late) = events[1:]
    assert [name for name, _ in events] == ["wave", "wave", "response", "late"]
    assert response - second_wave >= RESPONSES_AFTER_S * 0.9
    assert late - second_wave >= 0.02 + RESPONSE_HOLD_S * 0.9  # the wave's 20 ms, then the hold
