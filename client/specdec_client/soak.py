"""Bounded soak against a server on loopback: streaming gRPC requests to `ensemble` from N workers.

Bounded by time (`--duration-s`) and by count (`--max-requests`); a fraction of the requests can be cancelled
mid-stream (`--cancel-fraction`). Reports errors by message, latency percentiles, time to first token,
tokens/s, and the server's resident memory (all processes of its session: server and model processes) and KV
slots in use (`specdec_kv_slots_in_use` on the metrics port) over time; after the load it waits for the slots
to drain and reports where they and the memory ended.

    python -m specdec_client.soak --start-server --concurrency 32 --duration-s 600       # make soak
    python -m specdec_client.soak --start-server --max-requests 1000 --cancel-fraction 0.3  # make soak-cancel

Loopback only: any other address is refused.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ipaddress
import json
import queue
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tritonclient.grpc as grpcclient

from specdec_client.api import grpc_inputs
from specdec_client.bench import percentile
from specdec_client.scrape import scrape
from specdec_client.server import TritonServer, free_port, model_processes, session_processes

PROMPTS = Path(__file__).resolve().parent / "prompts" / "smoke.json"
SLOTS_METRIC = "specdec_kv_slots_in_use"
DRAIN_TIMEOUT_S = 60.0


def require_loopback(address: str) -> None:
    """Refuse anything but loopback: load goes to 127.0.0.1/::1 only."""
    host = address.rsplit(":", 1)[0].strip("[]").removeprefix("http://")
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(f"refusing to send load to {address}: loopback only (127.0.0.1)")


def process_resident_bytes(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def resident_bytes(session_id: int) -> int:
    """Sum of VmRSS over the processes of the server's session (shared pages count once per process)."""
    return sum(process_resident_bytes(pid) for pid in session_processes(session_id))


def resident_mb_by_process(session_id: int) -> dict[str, float]:
    """VmRSS in MB of tritonserver and of each model instance's process."""
    by_name = {"tritonserver": session_id, **model_processes(session_id)}
    return {name: round(process_resident_bytes(pid) / 2**20, 1) for name, pid in sorted(by_name.items())}


def kv_slots_in_use(metrics_url: str) -> int | None:
    """Sum of `specdec_kv_slots_in_use` over the decoder instances, or None when the metric is absent."""
    try:
        values = scrape(metrics_url, timeout_s=5).values(SLOTS_METRIC)
    except OSError:
        return None
    return int(sum(value for _, value in values)) if values else None


@dataclass
class Sample:
    t_s: float
    resident_mb: float
    kv_slots_in_use: int | None
    completed: int
    in_flight: int


@dataclass
class SoakReport:
    concurrency: int
    duration_s: float
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tokens_per_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    warm_resident_mb: float | None = None
    final_resident_mb: float | None = None
    memory_growth_pct: float | None = None
    final_kv_slots_in_use: int | None = None
    slots_drained_s: float | None = None
    warm_mb_by_process: dict[str, float] = field(default_factory=dict)
    final_mb_by_process: dict[str, float] = field(default_factory=dict)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    def text(self) -> str:
        def ms(value: float | None) -> str:
            return "n/a" if value is None else f"{value * 1000:.0f} ms"

        lines = [
            f"soak: {self.requests} requests in {self.duration_s:.0f} s at concurrency {self.concurrency}: "
            f"{self.completed} completed, {self.cancelled} cancelled mid-stream, {self.error_count} errors",
            f"latency P50 {ms(self.latency_p50_s)}, P99 {ms(self.latency_p99_s)}; time to first token P50 "
            f"{ms(self.ttft_p50_s)}, P99 {ms(self.ttft_p99_s)}; {self.tokens_per_s:.0f} output tokens/s",
        ]
        for message, count in sorted(self.errors.items(), key=lambda kv: -kv[1]):
            lines.append(f"  error x{count}: {message}")
        lines.append("resident memory (server + model processes) and KV slots in use over time:")
        for s in self.samples:
            lines.append(f"  t={s.t_s:6.0f} s  {s.resident_mb:8.1f} MB  slots={s.kv_slots_in_use!s:>4}  "
                         f"completed={s.completed:6d}  in_flight={s.in_flight:3d}")
        growth = "n/a" if self.memory_growth_pct is None else f"{self.memory_growth_pct:+.2f}%"
        lines.append(f"memory after warm-up {self.warm_resident_mb} MB -> after the run {self.final_resident_mb} MB "
                     f"({growth}); KV slots in use after the run: {self.final_kv_slots_in_use}"
                     + ("" if self.slots_drained_s is None else f" (drained {self.slots_drained_s:.1f} s after)"))
        for name, final in self.final_mb_by_process.items():
            warm = self.warm_mb_by_process.get(name)
            lines.append(f"  {name:26s} {warm!s:>8} MB -> {final:8.1f} MB")
        return "\n".join(lines)


class Soak:
    """Workers that each loop: one streaming request at a time, cancelled after a few chunks when drawn."""

    def __init__(self, grpc_url: str, metrics_url: str, server_session: int | None, concurrency: int = 32,
                 duration_s: float = 600.0, max_requests: int | None = None, cancel_fraction: float = 0.0,
                 max_tokens: tuple[int, ...] = (32, 64, 128), num_draft_tokens: int | None = None,
                 sample_s: float = 10.0, warmup_s: float | None = None, seed: int = 0,
                 answer_timeout_s: float = 300.0) -> None:
        require_loopback(grpc_url)
        require_loopback(metrics_url.removeprefix("http://").split("/", 1)[0])
        self.grpc_url, self.metrics_url, self.server_session = grpc_url, metrics_url, server_session
        self.concurrency, self.duration_s, self.max_requests = concurrency, duration_s, max_requests
        self.cancel_fraction, self.max_tokens, self.num_draft_tokens = cancel_fraction, max_tokens, num_draft_tokens
        self.sample_s = sample_s
        self.warmup_s = warmup_s if warmup_s is not None else min(60.0, duration_s / 5)
        self.answer_timeout_s = answer_timeout_s
        prompts = json.loads(PROMPTS.read_text())
        self.prompts = [p for domain in sorted(prompts) for p in prompts[domain]]
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._issued = 0
        self._in_flight = 0
        self._stop = threading.Event()
        self.latencies: list[float] = []
        self.ttfts: list[float] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.completed = self.cancelled = self.output_tokens = 0

    def _next(self) -> tuple[int, dict[str, Any], int | None] | None:
        """The next request (index, params, chunks before cancelling or None), or None when the run is over."""
        with self._lock:
            if self._stop.is_set() or (self.max_requests is not None and self._issued >= self.max_requests):
                return None
            index = self._issued
            self._issued += 1
            self._in_flight += 1
            params = {"text_input": self.prompts[index % len(self.prompts)], "stream": True,
                      "max_tokens": self._random.choice(self.max_tokens),
                      "num_draft_tokens": self.num_draft_tokens}
            cancel_after = self._random.randint(1, 3) if self._random.random() < self.cancel_fraction else None
            return index, params, cancel_after

    def _one(self, client: grpcclient.InferenceServerClient, params: dict[str, Any], cancel_after: int | None) -> None:
        answers: queue.Queue = queue.Queue()
        started = time.perf_counter()
        first = None
        chunks = 0
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        cancelled = False
        try:
            client.async_stream_infer("ensemble", grpc_inputs(params), enable_empty_final_response=False)
            while True:
                result, error = answers.get(timeout=self.answer_timeout_s)
                if error is not None:
                    with self._lock:
                        self.errors[str(error)[:200]] += 1
                    return
                chunks += 1
                if first is None:
                    first = time.perf_counter() - started
                if cancel_after is not None and chunks >= cancel_after:
                    cancelled = True
                    return
                final = result.get_response().parameters.get("triton_final_response")
                if final is None or final.bool_param:
                    tokens = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
                    with self._lock:
                        self.completed += 1
                        self.output_tokens += tokens
                        self.latencies.append(time.perf_counter() - started)
                        self.ttfts.append(first)
                    return
        except queue.Empty:
            with self._lock:
                self.errors[f"no answer within {self.answer_timeout_s:.0f} s"] += 1
        finally:
            client.stop_stream(cancel_requests=cancelled)
            with self._lock:
                self.cancelled += cancelled
                self._in_flight -= 1

    def _worker(self) -> None:
        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            while (item := self._next()) is not None:
                _, params, cancel_after = item
                try:
                    self._one(client, params, cancel_after)
                except Exception as exc:
                    with self._lock:
                        self.errors[f"{type(exc).__name__}: {exc}"[:200]] += 1
        finally:
            client.close()

    def _sample(self, started: float) -> Sample:
        resident = resident_bytes(self.server_session) if self.server_session else 0
        with self._lock:
            completed, in_flight = self.completed, self._in_flight
        return Sample(round(time.monotonic() - started, 1), round(resident / 2**20, 1),
                      kv_slots_in_use(self.metrics_url), completed, in_flight)

    def run(self, on_sample: Any = None) -> SoakReport:
        started = time.monotonic()
        report = SoakReport(self.concurrency, 0.0)
        workers = [threading.Thread(target=self._worker, daemon=True) for _ in range(self.concurrency)]
        for worker in workers:
            worker.start()
        deadline = started + self.duration_s
        next_sample = started
        while any(w.is_alive() for w in workers):
            now = time.monotonic()
            if now >= deadline:
                self._stop.set()
            if now >= next_sample:
                report.samples.append(self._sample(started))
                if not report.warm_mb_by_process and report.samples[-1].t_s >= self.warmup_s and self.server_session:
                    report.warm_mb_by_process = resident_mb_by_process(self.server_session)
                if on_sample:
                    on_sample(report.samples[-1])
                next_sample += self.sample_s
            time.sleep(min(0.5, max(0.05, next_sample - time.monotonic())))
        for worker in workers:
            worker.join(timeout=self.answer_timeout_s)
        report.duration_s = time.monotonic() - started
        self._drain(report, started)
        self._fill(report)
        return report

    def _drain(self, report: SoakReport, started: float) -> None:
        """Wait until every KV slot is free again (cancelled sequences end within an iteration)."""
        ended = time.monotonic()
        while True:
            slots = kv_slots_in_use(self.metrics_url)
            if slots == 0 or slots is None or time.monotonic() - ended > DRAIN_TIMEOUT_S:
                break
            time.sleep(0.2)
        report.final_kv_slots_in_use = slots
        report.slots_drained_s = round(time.monotonic() - ended, 1) if slots == 0 else None
        report.samples.append(self._sample(started))
        if self.server_session:
            report.final_mb_by_process = resident_mb_by_process(self.server_session)

    def _fill(self, report: SoakReport) -> None:
        report.requests = self._issued
        report.completed, report.cancelled = self.completed, self.cancelled
        report.errors = dict(self.errors)
        report.output_tokens = self.output_tokens
        report.latency_p50_s, report.latency_p99_s = percentile(self.latencies, 50), percentile(self.latencies, 99)
        report.ttft_p50_s, report.ttft_p99_s = percentile(self.ttfts, 50), percentile(self.ttfts, 99)
        report.tokens_per_s = self.output_tokens / report.duration_s if report.duration_s else 0.0
        if self.server_session:
            warm = [s for s in report.samples if s.t_s >= self.warmup_s] or report.samples
            report.warm_resident_mb = warm[0].resident_mb
            report.final_resident_mb = report.samples[-1].resident_mb
            if report.warm_resident_mb:
                report.memory_growth_pct = round(
                    100 * (report.final_resident_mb - report.warm_resident_mb) / report.warm_resident_mb, 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc-url", default="127.0.0.1:8001")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    parser.add_argument("--server-pid", type=int, help="pid of the tritonserver (for its resident memory)")
    parser.add_argument("--start-server", action="store_true", help="start a tritonserver on free loopback ports")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration-s", type=float, default=600.0, help="stop issuing requests after this long")
    parser.add_argument("--max-requests", type=int, help="stop issuing requests after this many")
    parser.add_argument("--cancel-fraction", type=float, default=0.0, help="cancel this share mid-stream")
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--num-draft-tokens", type=int)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, help="memory growth is measured from here (default: 1/5 run)")
    parser.add_argument("--max-memory-growth-pct", type=float, default=5.0)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    server = None
    if args.start_server:
        server = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                              log_file=Path(f"/tmp/specdec-soak-{time.strftime('%Y%m%d-%H%M%S')}.log"))
        print(f"starting tritonserver (log {server.log_file}) ...", flush=True)
        server.start(timeout_s=300)
        args.grpc_url, args.metrics_url, args.server_pid = server.grpc_url, server.metrics_url, server.process.pid
    try:
        soak = Soak(args.grpc_url, args.metrics_url, args.server_pid, args.concurrency, args.duration_s,
                    args.max_requests, args.cancel_fraction, tuple(args.max_tokens), args.num_draft_tokens,
                    args.sample_s, args.warmup_s)
        report = soak.run(on_sample=lambda s: print(f"  t={s.t_s:6.0f} s  {s.resident_mb:8.1f} MB  "
                                                    f"slots={s.kv_slots_in_use}  completed={s.completed}",
                                                    flush=True))
    finally:
        if server is not None:
            server.stop()
    print(report.text())
    if args.json:
        args.json.write_text(json.dumps(asdict(report), indent=1))
    growth_ok = report.memory_growth_pct is None or report.memory_growth_pct < args.max_memory_growth_pct
    return 0 if report.error_count == 0 and report.final_kv_slots_in_use == 0 and growth_ok else 1


if __name__ == "__main__":
    sys.exit(main())
