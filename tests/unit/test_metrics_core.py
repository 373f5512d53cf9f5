"""specdec.metrics: the metric catalogue is well-formed and requests feed it figures equal to their stats."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest
from specdec import metrics as m
from specdec.config import SpeculationSettings
from specdec.drafting.ngram import PromptLookup
from specdec.engines import DraftEngine, TargetEngine
from specdec.errors import CapacityError, InvalidRequestError, UnsupportedError
from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator, StepError
from specdec.inprocess import InProcessBackend
from specdec.runtime.torch_llama import TorchLlamaRuntime

NAME = re.compile(r"^specdec_[a-z_]+$")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_catalogue_is_well_formed():
    names = [spec.name for spec in m.ALL_METRICS]
    assert len(names) == len(set(names))
    for spec in m.ALL_METRICS:
        assert NAME.match(spec.name), spec.name
        assert spec.help and spec.labels and m.MODEL in spec.labels
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        if spec.kind == "histogram":
            assert spec.buckets and list(spec.buckets) == sorted(set(spec.buckets)), spec.name
            assert spec.name.endswith("_seconds")
        else:
            assert spec.buckets is None
        if spec.kind == "gauge":
            assert m.INSTANCE in spec.labels, spec.name  # instances must not overwrite each other's gauges
    assert set(m.OUTCOMES) >= {"length", "stop", "context", "cancelled", "error"}


def test_sink_rejects_wrong_labels():
    with pytest.raises(ValueError, match="takes labels"):
        m.InMemorySink().increment(m.OUTPUT_TOKENS, {m.MODEL: "x"}, 1)


@pytest.mark.parametrize(("exc", "kind"), [
    (UnsupportedError("beam_width", "no"), "unsupported"),
    (InvalidRequestError("max_tokens", "no"), "invalid_argument"),
    (CapacityError("full"), "capacity"),
    (StepError("target_model: boom"), "model_call"),
    (RuntimeError("?"), "internal"),
])
def test_error_kinds(exc, kind):
    assert m.error_kind(exc) == kind
    assert kind in m.ERROR_KINDS


def test_acceptance_window_expires_old_requests():
    clock = FakeClock()
    window = m.AcceptanceWindow(window_s=10, clock=clock)
    assert window.acceptance_rate == 0.0 and window.mean_accepted_length == 0.0
    window.add(proposed=10, accepted=5, passes=2)
    clock.now += 6
    window.add(proposed=10, accepted=9, passes=2)
    assert window.acceptance_rate == pytest.approx(14 / 20)
    assert window.mean_accepted_length == pytest.approx((14 + 4) / 4)
    clock.now += 6  # the first request leaves the window
    assert window.acceptance_rate == pytest.approx(9 / 10)
    assert window.mean_accepted_length == pytest.approx((9 + 2) / 2)


@pytest.fixture(scope="module")
def generator(tiny_pair):
    target_dir, draft_dir = tiny_pair
    backend = InProcessBackend(
        TargetEngine(TorchLlamaRuntime(target_dir, num_slots=2, max_length=128), idle_timeout_s=60),
        DraftEngine(TorchLlamaRuntime(draft_dir, num_slots=2, max_length=128), idle_timeout_s=60),
    )
    return SpeculativeGenerator(backend, max_context_length=128)


def run(generator: SpeculativeGenerator, metrics: m.GenerationMetrics, clock: FakeClock, task: str,
        request: GenerationRequest, seq: int) -> GenerationStats:
    """Serve one request the way speculative_decoding does; each iteration takes 10 ms of fake time."""
    timer = metrics.start(task)
    timer.stats = GenerationStats()

    async def go() -> str | None:
        reason = None
        async for update in generator.generate(request, seq, timer.stats):
            clock.now += 0.010
            timer.tokens(len(update.token_ids))
            reason = update.finish_reason
        return reason

    metrics.begin_generation()
    reason = asyncio.run(go())
    metrics.end_generation()
    metrics.finish(timer, reason or "cancelled")
    return timer.stats


def test_recorded_figures_equal_the_requests_stats(generator):
    clock = FakeClock()
    sink = m.InMemorySink()
    metrics = m.GenerationMetrics(sink, "speculative_decoding", "inst_0", clock=clock, window_clock=clock)
    prompts = [[5, 17, 42], [8, 66, 3, 91], [44, 10]]
    per_task: dict[str, list[GenerationStats]] = {"json": [], "code": []}
    for n, prompt in enumerate(prompts):
        for task, k in (("json", 4), ("code", 0)):
            request = GenerationRequest(prompt, 24, num_draft_tokens=k)
            per_task[task].append(run(generator, metrics, clock, task, request, 10 * n + k))
    spec_stats = per_task["json"]
    assert sum(s.draft_tokens for s in spec_stats) > 0
    for task, runs in per_task.items():
        assert sink.total(m.REQUESTS, task=task) == len(runs) == sink.total(m.REQUESTS, task=task, outcome="length")
        assert sink.total(m.OUTPUT_TOKENS, task=task) == sum(s.output_tokens for s in runs) == 24 * len(runs)
        assert sink.total(m.DRAFT_TOKENS, task=task) == sum(s.draft_tokens for s in runs)
        assert sink.total(m.ACCEPTED_DRAFT_TOKENS, task=task) == sum(s.accepted_draft_tokens for s in runs)
        assert sink.total(m.ACCEPTED_BY_POSITION, task=task) == sum(s.accepted_draft_tokens for s in runs)
        assert sink.total(m.VERIFICATION_PASSES, task=task) == sum(s.verification_passes for s in runs)
        assert sink.total(m.TARGET_CALLS, task=task) == sum(s.target_calls for s in runs)
        assert len(sink.observed(m.TTFT, task=task)) == len(runs) == len(sink.observed(m.DURATION, task=task))
        assert sink.observed(m.TTFT, task=task) == pytest.approx([0.010] * len(runs))
        # Every iteration took 10 ms: the mean gap per token is 10 ms * (iterations - 1) / (tokens - 1).
        for itl, s in zip(sink.observed(m.ITL, task=task), runs, strict=True):
            assert itl == pytest.approx(0.010 * (s.target_calls - 1) / (s.output_tokens - 1))
    gauge = {m.MODEL: "speculative_decoding", m.TASK: "json", m.INSTANCE: "inst_0"}
    accepted = sum(s.accepted_draft_tokens for s in spec_stats)
    passes = sum(s.verification_passes for s in spec_stats)
    assert sink.total(m.ACCEPTANCE_RATE, **gauge) == pytest.approx(accepted / sum(s.draft_tokens for s in spec_stats))
    assert sink.total(m.MEAN_ACCEPTED_LENGTH, **gauge) == pytest.approx((accepted + passes) / passes)
    assert sink.total(m.SPECULATION_LENGTH, **gauge) == pytest.approx(
        sum(s.draft_tokens for s in spec_stats[-1:]) / sum(s.verification_passes for s in spec_stats[-1:]))
    assert 1 <= sink.total(m.SPECULATION_LENGTH, **gauge) <= 4
    assert sink.total(m.SPECULATION_LENGTH, task="code") == 0
    assert sink.total(m.FALLBACK_ACTIVE) == 0
    assert sink.total(m.ACCEPTANCE_RATE, task="code") == 0  # plain decoding never sets the window gauges
    assert metrics.active == 0
    assert sink.total(m.ERRORS) == 0


def test_failed_request_counts_an_error_and_no_tokens():
    sink = m.InMemorySink()
    metrics = m.GenerationMetrics(sink, "speculative_decoding", "inst_0")
    timer = metrics.start(m.UNKNOWN_TASK)
    metrics.finish(timer, "error", error=UnsupportedError("beam_width", "beam_width > 1"))
    assert sink.total(m.REQUESTS, outcome="error", task="unknown") == 1
    assert sink.total(m.ERRORS, kind="unsupported") == 1
    assert sink.total(m.OUTPUT_TOKENS) == 0 and not sink.observed(m.TTFT)
    assert len(sink.observed(m.DURATION)) == 1


def test_draft_failures_are_errors_and_fallback():
    sink = m.InMemorySink()
    metrics = m.GenerationMetrics(sink, "speculative_decoding", "inst_0")
    timer = metrics.start("text")
    timer.stats = GenerationStats(output_tokens=3, target_calls=3, draft_failures=1)
    timer.tokens(1)
    timer.tokens(2)
    metrics.finish(timer, "length")
    assert sink.total(m.ERRORS, kind="draft_failure") == 1
    assert sink.total(m.FALLBACK_ACTIVE) == 1 and sink.total(m.SPECULATION_LENGTH) == 0


def test_process_metrics_publish_changed_gauges_and_memory_every_few_ticks():
    sink = m.InMemorySink()
    calls: list[str] = []
    original = sink.set

    def counting_set(spec, labels, value):
        calls.append(spec.name)
        original(spec, labels, value)

    sink.set = counting_set  # type: ignore[method-assign]
    slots = [0]
    proc = m.ProcessMetrics(sink, "target_model", "target_model_0", gauges={m.KV_SLOTS_IN_USE: lambda: slots[0]},
                            num_slots=16, kv_cache_bytes=1 << 20, memory_every=3, background=False)
    assert sink.total(m.KV_SLOTS) == 16 and sink.total(m.KV_CACHE_BYTES) == 1 << 20
    assert sink.total(m.KV_SLOTS_IN_USE) == 0
    rss = sink.total(m.RESIDENT_MEMORY)
    assert rss > 10 << 20  # this Python process with torch loaded
    assert 0 < sink.total(m.UNIQUE_MEMORY) <= sink.total(m.PROPORTIONAL_MEMORY) <= rss
    calls.clear()
    proc.publish()  # tick 1: nothing changed, no memory tick
    slots[0] = 2
    proc.publish()  # tick 2: slots changed
    assert calls == [m.KV_SLOTS_IN_USE.name] and sink.total(m.KV_SLOTS_IN_USE) == 2
    calls.clear()
    proc.publish()  # tick 3: memory
    assert m.KV_SLOTS_IN_USE.name not in calls and m.RESIDENT_MEMORY.name in calls


def test_background_thread_publishes_without_the_request_path():
    sink = m.InMemorySink()
    active = [0]
    proc = m.ProcessMetrics(sink, "speculative_decoding", "sd_0", gauges={m.ACTIVE_REQUESTS: lambda: active[0]},
                            interval_s=0.02)
    try:
        active[0] = 3
        deadline = time.monotonic() + 5
        while sink.total(m.ACTIVE_REQUESTS) != 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sink.total(m.ACTIVE_REQUESTS) == 3
    finally:
        proc.close()


def test_every_metric_is_documented():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "OBSERVABILITY.md").read_text()
    assert [spec.name for spec in m.ALL_METRICS if f"`{spec.name}`" not in doc] == []


def test_prompt_lookup_counters_equal_the_requests_stats(generator):
    clock = FakeClock()
    sink = m.InMemorySink()
    metrics = m.GenerationMetrics(sink, "speculative_decoding", "inst_0", clock=clock, window_clock=clock)
    settings = SpeculationSettings("text", "model+ngram", 2, 2, 1, "greedy", 0.7, explicit_length=True,
                                   prompt_lookup=PromptLookup(length=6, min_ngram=1))
    runs = [run(generator, metrics, clock, "text", GenerationRequest(prompt, 24, settings=settings), 70 + n)
            for n, prompt in enumerate([[7, 1, 2, 3, 9, 7, 1, 2, 3], [4, 4, 4, 4, 4]])]
    assert sum(s.lookup_draft_tokens for s in runs) > 0
    assert sink.total(m.LOOKUP_DRAFT_TOKENS, task="text") == sum(s.lookup_draft_tokens for s in runs)
    assert sink.total(m.LOOKUP_ACCEPTED_TOKENS, task="text") == sum(s.lookup_accepted_tokens for s in runs)
    assert sink.total(m.DRAFTER_REQUESTS, task="text", drafter="model+ngram") == len(runs)


def test_batch_counter_buckets_executions_and_publishes_only_new_counts():
    assert [m.batch_size_bucket(n) for n in (1, 2, 3, 4, 5, 16, 17, 64, 200)] == [1, 2, 4, 4, 8, 16, 32, 64, 64]
    counter, sink = m.BatchCounter(), m.InMemorySink()
    for steps in (1, 1, 3, 16, 0):
        counter.count(steps)
    counter.publish(sink, "target_model")
    counter.publish(sink, "target_model")  # nothing new: no double count
    counter.count(2)
    counter.publish(sink, "target_model")
    by_bucket = {bound: sink.total(m.DECODER_BATCHES, batch_size=str(bound)) for bound in (1, 2, 4, 16)}
    assert by_bucket == {1: 2, 2: 1, 4: 1, 16: 1}
    assert sink.total(m.DECODER_STEPS, model="target_model") == 1 + 1 + 3 + 16 + 2


def test_phase_seconds_are_recorded_per_request():
    from specdec.generation import GenerationStats

    sink = m.InMemorySink()
    metrics = m.GenerationMetrics(sink, "speculative_decoding", "i0")
    timer = metrics.start("code")
    timer.stats = GenerationStats(output_tokens=3)
    timer.stats.add_time("target", 0.5)
    timer.stats.add_time("target", 0.25)
    timer.stats.add_time("accept", 0.1)
    timer.stats.iteration_seconds = 1.0
    metrics.finish(timer, "length")
    assert sink.total(m.GENERATION_SECONDS, phase="target") == pytest.approx(0.75)
    assert sink.total(m.GENERATION_SECONDS, phase="accept") == pytest.approx(0.1)
    assert sink.total(m.GENERATION_SECONDS, phase="other") == pytest.approx(0.15)
