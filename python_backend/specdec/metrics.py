"""The project's Prometheus metrics: names, help texts, label names, buckets, and how requests feed them.

Triton-free. `specdec_triton.metrics` turns each `MetricSpec` into a `pb_utils.MetricFamily` on Triton's
metrics port (next to Triton's own `nv_inference_*`); tests use `InMemorySink`. This module is the one
place where a metric name, help text, label name or bucket boundary is written down (docs/OBSERVABILITY.md
describes them for operators).

Label `model` is the Triton model that reports the series (as in Triton's own metrics), `task` the request's
task (json | code | text, as resolved for the request; `unknown` when the request could not be parsed),
`model_instance` the model instance (gauges only: each instance process sets its own value; counters and
histograms of several instances with equal labels add up in Triton's registry). Not `instance`: Prometheus
gives that label to the scrape target.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from specdec.errors import CapacityError, InvalidRequestError, SequenceStateError, UnsupportedError

Kind = Literal["counter", "gauge", "histogram"]

# ---- label names ----
MODEL = "model"
TASK = "task"
INSTANCE = "model_instance"  # not "instance": Prometheus sets that label to the scraped target
OUTCOME = "outcome"
ERROR_KIND = "kind"
POSITION = "position"
DRAFTER = "drafter"
BATCH_SIZE = "batch_size"
PHASE = "phase"

UNKNOWN_TASK = "unknown"
# Outcomes of a request: the generator's finish reasons plus "error".
OUTCOMES = ("length", "stop", "context", "cancelled", "error")
# Error kinds (label values of specdec_errors_total).
ERROR_KINDS = ("invalid_argument", "unsupported", "capacity", "sequence_state", "model_call", "internal",
               "draft_failure")

# ---- windows and throttles ----
ACCEPTANCE_WINDOW_S = 60.0  # the windowed acceptance-rate and mean-accepted-length gauges look back this far
GAUGE_INTERVAL_S = 1.0  # each model process publishes its slot / in-flight gauges this often (when changed)
MEMORY_EVERY = 5  # ... and samples its memory every this many intervals

# ---- histogram buckets (seconds) ----
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] | None = None


_REQ = (MODEL, TASK)
_GAUGE = (MODEL, TASK, INSTANCE)
_PROC = (MODEL, INSTANCE)

# ---- tier 2: speculation (reported by speculative_decoding) ----
REQUESTS = MetricSpec("specdec_requests_total", "counter",
                      "Generation requests finished, by outcome (length, stop, context, cancelled, error).",
                      (*_REQ, OUTCOME))
OUTPUT_TOKENS = MetricSpec("specdec_output_tokens_total", "counter", "Tokens generated and returned.", _REQ)
DRAFT_TOKENS = MetricSpec("specdec_draft_tokens_total", "counter", "Draft tokens proposed for verification.", _REQ)
ACCEPTED_DRAFT_TOKENS = MetricSpec("specdec_accepted_draft_tokens_total", "counter",
                                   "Draft tokens accepted by the target model.", _REQ)
ACCEPTED_BY_POSITION = MetricSpec("specdec_accepted_draft_tokens_by_position_total", "counter",
                                  "Accepted draft tokens by their position in the proposal (0 = first).",
                                  (*_REQ, POSITION))
LOOKUP_DRAFT_TOKENS = MetricSpec("specdec_lookup_draft_tokens_total", "counter",
                                 "Of the draft tokens proposed, those prompt lookup proposed (drafters ngram, "
                                 "model+ngram, eagle+ngram).", _REQ)
LOOKUP_ACCEPTED_TOKENS = MetricSpec("specdec_lookup_accepted_draft_tokens_total", "counter",
                                    "Of the draft tokens accepted, those prompt lookup proposed.", _REQ)
GRAMMAR_DRAFT_TOKENS = MetricSpec("specdec_grammar_draft_tokens_total", "counter",
                                  "Of the draft tokens proposed, those a constrained request's grammar forced "
                                  "(drafted at no model cost).", _REQ)
GRAMMAR_ACCEPTED_TOKENS = MetricSpec("specdec_grammar_accepted_draft_tokens_total", "counter",
                                     "Of the draft tokens accepted, those the grammar forced.", _REQ)
GRAMMAR_PRUNED_TOKENS = MetricSpec("specdec_grammar_pruned_draft_tokens_total", "counter",
                                   "Draft tokens cut before verification because the request's grammar forbids "
                                   "them.", _REQ)
DRAFTER_REQUESTS = MetricSpec("specdec_drafter_requests_total", "counter",
                              "Generation requests by the drafter that proposed for them (model, eagle, ngram, "
                              "model+ngram, eagle+ngram; none: plain decoding).", (*_REQ, DRAFTER))
VERIFICATION_PASSES = MetricSpec("specdec_verification_passes_total", "counter",
                                 "Target forward passes that verified a draft proposal.", _REQ)
TARGET_CALLS = MetricSpec("specdec_target_calls_total", "counter",
                          "Target model calls (prefill, verification and plain decoding steps).", _REQ)
DRAFT_CALLS = MetricSpec("specdec_draft_calls_total", "counter", "Draft model calls (one per proposal).", _REQ)
ERRORS = MetricSpec("specdec_errors_total", "counter",
                    "Errors by kind: invalid_argument, unsupported, capacity, sequence_state, model_call, "
                    "internal; draft_failure counts draft calls that failed and degraded a request to plain "
                    "decoding.", (*_REQ, ERROR_KIND))
TTFT = MetricSpec("specdec_time_to_first_token_seconds", "histogram",
                  "Time from request arrival at speculative_decoding to its first generated token.", _REQ,
                  TTFT_BUCKETS)
ITL = MetricSpec("specdec_inter_token_latency_seconds", "histogram",
                 "Mean inter-token latency of a request: (last token time - first token time) / (tokens - 1); "
                 "one observation per request with at least two tokens.", _REQ, ITL_BUCKETS)
DURATION = MetricSpec("specdec_request_duration_seconds", "histogram",
                      "Time from request arrival at speculative_decoding to its last response.", _REQ,
                      DURATION_BUCKETS)
ACCEPTANCE_RATE = MetricSpec("specdec_acceptance_rate", "gauge",
                             f"Accepted / proposed draft tokens over the last {ACCEPTANCE_WINDOW_S:.0f} s of "
                             "finished requests (alpha).", _GAUGE)
MEAN_ACCEPTED_LENGTH = MetricSpec("specdec_mean_accepted_length", "gauge",
                                  f"Tokens emitted per verification pass over the last {ACCEPTANCE_WINDOW_S:.0f} s "
                                  "of finished requests: accepted draft tokens + the bonus token (tau).", _GAUGE)
SPECULATION_LENGTH = MetricSpec("specdec_speculation_length", "gauge",
                                "Mean draft tokens per verification pass of the most recent request: the speculation "
                                "length in use, adaptive or fixed (0 = plain decoding).", _GAUGE)
FALLBACK_ACTIVE = MetricSpec("specdec_fallback_active", "gauge",
                             "1 when the most recent request fell back to plain decoding (low acceptance or a "
                             "failing draft model), else 0.", _GAUGE)
ACTIVE_REQUESTS = MetricSpec("specdec_active_requests", "gauge",
                             "Requests being generated now (holding a KV slot).", _PROC)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # a decoder execution's step count, counted up to each bound
# Phases of a generation's iterations (specdec_generation_seconds_total): waiting for and running the drafter
# model, prompt lookup, waiting for the target call's wave (specdec.waves), the target call (queue + forward +
# transport), acceptance and sampling over the target's logits, and everything else in the loop.
PHASES = ("draft", "lookup", "wait", "target", "accept", "other")
GENERATION_SECONDS = MetricSpec("specdec_generation_seconds_total", "counter",
                                "Seconds generations spent per phase of their prefill and iterations (draft, "
                                "lookup, wait, target, accept, other), summed over sequences: divided by "
                                "specdec_target_calls_total, the time of one iteration of one sequence.",
                                (*_REQ, PHASE))

# ---- tier 1 addition: how full decoder executions are (reported by target_model, draft_model, eagle_draft) ----
DECODER_BATCHES = MetricSpec("specdec_decoder_executions_total", "counter",
                             "Decoder executions by the number of sequence steps they served (batch_size: the "
                             "bucket's upper bound, 1, 2, 4, 8, 16, 32, 64).", (MODEL, BATCH_SIZE))
DECODER_STEPS = MetricSpec("specdec_decoder_steps_total", "counter",
                           "Sequence steps decoder executions served (a packed request carries several): divided by "
                           "the executions of specdec_decoder_executions_total, the mean batch.", (MODEL,))

# ---- tier 3: resources (reported by every model process that wires them) ----
KV_SLOTS_IN_USE = MetricSpec("specdec_kv_slots_in_use", "gauge", "KV-cache slots held by live sequences.", _PROC)
KV_SLOTS = MetricSpec("specdec_kv_slots", "gauge", "KV-cache slots preallocated in the instance.", _PROC)
KV_CACHE_BYTES = MetricSpec("specdec_kv_cache_bytes", "gauge", "Bytes of the KV pool (the budget, allocated at load).",
                            _PROC)
KV_BLOCKS = MetricSpec("specdec_kv_blocks", "gauge", "KV blocks in the instance's pool.", _PROC)
KV_BLOCKS_IN_USE = MetricSpec("specdec_kv_blocks_in_use", "gauge", "KV blocks held by live sequences.", _PROC)
KV_BYTES_IN_USE = MetricSpec("specdec_kv_bytes_in_use", "gauge", "Bytes of the KV blocks held by live sequences.",
                             _PROC)
RESIDENT_MEMORY = MetricSpec("specdec_resident_memory_bytes", "gauge",
                             "Resident set size (RSS) of the model instance's process.", _PROC)
PROPORTIONAL_MEMORY = MetricSpec("specdec_proportional_memory_bytes", "gauge",
                                 "Proportional set size (PSS) of the model instance's process: shared pages "
                                 "split between the processes that map them (sums to the real total).", _PROC)
UNIQUE_MEMORY = MetricSpec("specdec_unique_memory_bytes", "gauge",
                           "Unique set size (USS: private pages) of the model instance's process: what unloading "
                           "it would free, e.g. the memory cost of loading the draft model.", _PROC)

ALL_METRICS = (
    REQUESTS, OUTPUT_TOKENS, DRAFT_TOKENS, ACCEPTED_DRAFT_TOKENS, LOOKUP_DRAFT_TOKENS, LOOKUP_ACCEPTED_TOKENS,
    GRAMMAR_DRAFT_TOKENS, GRAMMAR_ACCEPTED_TOKENS, GRAMMAR_PRUNED_TOKENS,
    ACCEPTED_BY_POSITION, VERIFICATION_PASSES, TARGET_CALLS, DRAFT_CALLS, DRAFTER_REQUESTS, ERRORS, TTFT, ITL,
    DURATION, ACCEPTANCE_RATE, MEAN_ACCEPTED_LENGTH,
    SPECULATION_LENGTH, FALLBACK_ACTIVE, ACTIVE_REQUESTS, GENERATION_SECONDS, DECODER_BATCHES, DECODER_STEPS,
    KV_SLOTS_IN_USE,
    KV_SLOTS, KV_CACHE_BYTES, KV_BLOCKS, KV_BLOCKS_IN_USE, KV_BYTES_IN_USE,
    RESIDENT_MEMORY, PROPORTIONAL_MEMORY, UNIQUE_MEMORY,
)
BY_NAME = {spec.name: spec for spec in ALL_METRICS}


class MetricSink(Protocol):
    """Where metric updates go (Triton's registry in production, a dict in tests)."""

    def increment(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None: ...

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None: ...

    def observe(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None: ...


def _key(spec: MetricSpec, labels: Mapping[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    if set(labels) != set(spec.labels):
        raise ValueError(f"{spec.name} takes labels {spec.labels}, got {sorted(labels)}")
    return spec.name, tuple(sorted(labels.items()))


@dataclass
class InMemorySink:
    """A MetricSink that keeps values in dicts keyed by (name, sorted labels): for tests and tools."""

    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    observations: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = field(default_factory=dict)

    def increment(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        key = _key(spec, labels)
        self.values[key] = self.values.get(key, 0.0) + value

    def set(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self.values[_key(spec, labels)] = value

    def observe(self, spec: MetricSpec, labels: Mapping[str, str], value: float) -> None:
        self.observations.setdefault(_key(spec, labels), []).append(value)

    def total(self, spec: MetricSpec, **match: str) -> float:
        """Sum of the values of `spec` whose labels include `match`."""
        return sum(v for (name, labels), v in self.values.items()
                   if name == spec.name and set(match.items()) <= set(labels))

    def observed(self, spec: MetricSpec, **match: str) -> list[float]:
        return [x for (name, labels), xs in self.observations.items()
                if name == spec.name and set(match.items()) <= set(labels) for x in xs]


def error_kind(exc: BaseException) -> str:
    """The `kind` label of an exception that failed a request."""
    from specdec.generation import StepError  # generation imports nothing from here; avoid a cycle anyway

    if isinstance(exc, UnsupportedError):
        return "unsupported"
    if isinstance(exc, InvalidRequestError):
        return "invalid_argument"
    if isinstance(exc, CapacityError):
        return "capacity"
    if isinstance(exc, SequenceStateError):
        return "sequence_state"
    if isinstance(exc, StepError):
        return "model_call"
    return "internal"


def _stat(stats: Any, names: Iterable[str], default: Any) -> Any:
    """First present attribute of `stats` among `names` (fields the speculation engine may add)."""
    for name in names:
        value = getattr(stats, name, None)
        if value is not None:
            return value
    return default


class AcceptanceWindow:
    """Draft tokens proposed/accepted and verification passes of requests finished in the last `window_s`."""

    def __init__(self, window_s: float = ACCEPTANCE_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._events: collections.deque[tuple[float, int, int, int]] = collections.deque()
        self._proposed = self._accepted = self._passes = 0

    def add(self, proposed: int, accepted: int, passes: int) -> None:
        self._expire()
        self._events.append((self._clock(), proposed, accepted, passes))
        self._proposed += proposed
        self._accepted += accepted
        self._passes += passes

    def _expire(self) -> None:
        horizon = self._clock() - self.window_s
        while self._events and self._events[0][0] < horizon:
            _, proposed, accepted, passes = self._events.popleft()
            self._proposed -= proposed
            self._accepted -= accepted
            self._passes -= passes

    @property
    def acceptance_rate(self) -> float:
        self._expire()
        return self._accepted / self._proposed if self._proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verification pass: accepted drafts plus the bonus token of each pass."""
        self._expire()
        return (self._accepted + self._passes) / self._passes if self._passes else 0.0


@dataclass
class RequestTimer:
    """One request's task, statistics (its GenerationStats, once generating) and client-visible timings,
    taken where the tokens leave the generator."""

    task: str
    started: float
    stats: Any = None
    first_token: float | None = None
    last_token: float | None = None
    clock: Callable[[], float] = time.perf_counter

    def tokens(self, count: int) -> None:
        """Call when `count` new tokens are ready to be sent."""
        if count <= 0:
            return
        now = self.clock()
        if self.first_token is None:
            self.first_token = now
        self.last_token = now


class GenerationMetrics:
    """Feeds the speculation metrics of one model instance from finished requests."""

    def __init__(self, sink: MetricSink, model: str, instance: str,
                 clock: Callable[[], float] = time.perf_counter,
                 window_clock: Callable[[], float] = time.monotonic) -> None:
        self.sink = sink
        self.model = model
        self.instance = instance
        self.clock = clock
        self._window_clock = window_clock
        self._windows: dict[str, AcceptanceWindow] = {}
        self._active = 0

    def start(self, task: str) -> RequestTimer:
        return RequestTimer(task=task, started=self.clock(), clock=self.clock)

    def begin_generation(self) -> None:
        """Count a generation in flight (published by ProcessMetrics, off the request path)."""
        self._active += 1

    def end_generation(self) -> None:
        self._active -= 1

    @property
    def active(self) -> int:
        return self._active

    def finish(self, timer: RequestTimer, outcome: str, error: BaseException | None = None) -> None:
        """Record one request: its outcome, token counts, timings and (for speculation) the window gauges."""
        now = self.clock()
        stats = timer.stats
        labels = {MODEL: self.model, TASK: timer.task}
        sink = self.sink
        sink.increment(REQUESTS, {**labels, OUTCOME: outcome}, 1)
        if error is not None:
            sink.increment(ERRORS, {**labels, ERROR_KIND: error_kind(error)}, 1)
        sink.observe(DURATION, labels, now - timer.started)
        if timer.first_token is not None:
            sink.observe(TTFT, labels, timer.first_token - timer.started)
        if stats is None:
            return
        tokens = int(stats.output_tokens)
        sink.increment(DRAFTER_REQUESTS, {**labels, DRAFTER: _stat(stats, ("drafter",), "") or "none"}, 1)
        if tokens > 1 and timer.first_token is not None and timer.last_token is not None:
            sink.observe(ITL, labels, (timer.last_token - timer.first_token) / (tokens - 1))
        for spec, value in ((OUTPUT_TOKENS, tokens), (DRAFT_TOKENS, stats.draft_tokens),
                            (ACCEPTED_DRAFT_TOKENS, stats.accepted_draft_tokens),
                            (LOOKUP_DRAFT_TOKENS, _stat(stats, ("lookup_draft_tokens",), 0)),
                            (LOOKUP_ACCEPTED_TOKENS, _stat(stats, ("lookup_accepted_tokens",), 0)),
                            (GRAMMAR_DRAFT_TOKENS, _stat(stats, ("grammar_draft_tokens",), 0)),
                            (GRAMMAR_ACCEPTED_TOKENS, _stat(stats, ("grammar_accepted_tokens",), 0)),
                            (GRAMMAR_PRUNED_TOKENS, _stat(stats, ("grammar_pruned_tokens",), 0)),
                            (VERIFICATION_PASSES, stats.verification_passes), (TARGET_CALLS, stats.target_calls),
                            (DRAFT_CALLS, stats.draft_calls)):
            if value:
                sink.increment(spec, labels, value)
        for position, accepted in enumerate(stats.accepted_per_position):
            if accepted:
                sink.increment(ACCEPTED_BY_POSITION, {**labels, POSITION: str(position)}, accepted)
        if stats.draft_failures:
            sink.increment(ERRORS, {**labels, ERROR_KIND: "draft_failure"}, stats.draft_failures)
        phases = dict(_stat(stats, ("phase_seconds",), {}))
        phases["other"] = _stat(stats, ("iteration_seconds",), 0.0) - sum(phases.values())
        for phase, seconds in phases.items():
            if seconds > 0:
                sink.increment(GENERATION_SECONDS, {**labels, PHASE: phase}, seconds)
        gauge_labels = {**labels, INSTANCE: self.instance}
        # Mean k rather than the last step's k, which is cut short near max_tokens.
        length = stats.draft_tokens / stats.verification_passes if stats.verification_passes else 0.0
        fallback = bool(_stat(stats, ("fallback_active",), False)) or stats.draft_failures > 0
        sink.set(SPECULATION_LENGTH, gauge_labels, length)
        sink.set(FALLBACK_ACTIVE, gauge_labels, 1.0 if fallback else 0.0)
        if stats.draft_tokens:
            window = self._windows.get(timer.task)
            if window is None:
                window = self._windows[timer.task] = AcceptanceWindow(clock=self._window_clock)
            window.add(stats.draft_tokens, stats.accepted_draft_tokens, stats.verification_passes)
            sink.set(ACCEPTANCE_RATE, gauge_labels, window.acceptance_rate)
            sink.set(MEAN_ACCEPTED_LENGTH, gauge_labels, window.mean_accepted_length)


@dataclass
class ProcessMemory:
    rss: int
    pss: int | None = None  # None where /proc/self/smaps_rollup is missing
    uss: int | None = None


def process_memory() -> ProcessMemory:
    """RSS, PSS and USS of this process in bytes (one read of /proc/self/statm and smaps_rollup)."""
    rss = 0
    pss = uss = None
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak: the best portable figure
    try:
        with open("/proc/self/smaps_rollup") as f:
            fields = {parts[0]: int(parts[1]) * 1024 for parts in (line.split() for line in f)
                      if len(parts) == 3 and parts[2] == "kB"}
        pss = fields.get("Pss:")
        uss = fields.get("Private_Clean:", 0) + fields.get("Private_Dirty:", 0)
    except (OSError, ValueError, IndexError):
        pss = uss = None
    return ProcessMemory(rss, pss, uss)


def batch_size_bucket(steps: int) -> int:
    """The BATCH_SIZE_BUCKETS bound an execution of `steps` sequence steps is counted under."""
    return next((bound for bound in BATCH_SIZE_BUCKETS if steps <= bound), BATCH_SIZE_BUCKETS[-1])


class BatchCounter:
    """Counts a decoder's executions by batch size on the request path (a dict update), published by
    ProcessMetrics' thread as specdec_decoder_executions_total (a metric update is a round trip to the
    server: never one per execution)."""

    def __init__(self) -> None:
        self.counts: collections.Counter[int] = collections.Counter()
        self._published: collections.Counter[int] = collections.Counter()
        self.steps = self._published_steps = 0

    def count(self, steps: int) -> None:
        if steps > 0:
            self.counts[batch_size_bucket(steps)] += 1
            self.steps += steps

    def publish(self, sink: MetricSink, model: str) -> None:
        for bound, total in list(self.counts.items()):
            new = total - self._published[bound]
            if new > 0:
                sink.increment(DECODER_BATCHES, {MODEL: model, BATCH_SIZE: str(bound)}, new)
                self._published[bound] = total
        steps = self.steps
        if steps > self._published_steps:
            sink.increment(DECODER_STEPS, {MODEL: model}, steps - self._published_steps)
            self._published_steps = steps


class ProcessMetrics:
    """Gauges of one model instance process, published by a background thread, never on the request path.

    Each metric update is a round trip from the model process to the server; inside a decoder's execute()
    that round trip was measured at milliseconds on a loaded machine (py-spy, docs/BENCHMARKS.md), and
    reading /proc/self/smaps_rollup walks the page tables. So a daemon thread publishes, every `interval_s`,
    the `gauges` (name -> callable, e.g. KV slots in use) whose value changed, and every `memory_every`
    intervals the process's RSS/PSS/USS. `background=False` leaves the ticking to the caller (`publish()`).
    """

    def __init__(self, sink: MetricSink, model: str, instance: str,
                 gauges: Mapping[MetricSpec, Callable[[], float]] | None = None, num_slots: int | None = None,
                 kv_cache_bytes: int | None = None, kv_blocks: int | None = None,
                 interval_s: float = GAUGE_INTERVAL_S,
                 memory_every: int = MEMORY_EVERY, background: bool = True,
                 batches: BatchCounter | None = None) -> None:
        self.sink = sink
        self.labels = {MODEL: model, INSTANCE: instance}
        self.batches = batches
        self.gauges = dict(gauges or {})
        self.interval_s = interval_s
        self.memory_every = memory_every
        self._ticks = 0
        self._last: dict[str, float] = {}
        self._stop = threading.Event()
        if num_slots is not None:
            sink.set(KV_SLOTS, self.labels, num_slots)
        if kv_cache_bytes is not None:
            sink.set(KV_CACHE_BYTES, self.labels, kv_cache_bytes)
        if kv_blocks is not None:
            sink.set(KV_BLOCKS, self.labels, kv_blocks)
        self.publish()
        if background:
            threading.Thread(target=self._run, name="specdec-metrics", daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.publish()

    def publish(self) -> None:
        """One tick: the gauges that changed, new batch counts, and the memory gauges every `memory_every`
        ticks."""
        if self.batches is not None:
            self.batches.publish(self.sink, self.labels[MODEL])
        for spec, read in self.gauges.items():
            value = float(read())
            if self._last.get(spec.name) != value:
                self._last[spec.name] = value
                self.sink.set(spec, self.labels, value)
        if self._ticks % self.memory_every == 0:
            memory = process_memory()
            self.sink.set(RESIDENT_MEMORY, self.labels, memory.rss)
            if memory.pss is not None:
                self.sink.set(PROPORTIONAL_MEMORY, self.labels, memory.pss)
            if memory.uss is not None:
                self.sink.set(UNIQUE_MEMORY, self.labels, memory.uss)
        self._ticks += 1

    def close(self) -> None:
        """Stop the publishing thread (before the sink's metrics are dropped)."""
        self._stop.set()
