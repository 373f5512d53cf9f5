"""`load-profile`: where a server's time goes under load.

Closed-loop load (each of `concurrency` workers sends its next request when the last one finished) of the
held-out chat requests (`prompts/bench_chat.json`) through gRPC, plain (num_draft_tokens 0) and speculative
(the task profiles) cells interleaved, greedy or sampled. Per cell it prints output tokens/s, P50/P99
latency, and from the metrics, per decoder model: executions, the mean batch per execution
(`specdec_decoder_steps_total` / `specdec_decoder_executions_total`: a packed request carries a wave of steps),
the distribution of batch sizes, the request-weighted compute time of an execution and the mean time a request
waited in Triton's queue; and from speculative_decoding, the time of one sequence's iteration in each phase
(`specdec_generation_seconds_total` / `specdec_target_calls_total`).

    load-profile --start-server --concurrency 1,4,16,64 --modes plain,speculative --sampling greedy,t0.7
    load-profile --url 127.0.0.1:8001 --metrics-url http://127.0.0.1:8002/metrics --concurrency 16

Writes results.json and results.md into --out. Not a test: figures vary with the machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec_client.api import generate_grpc
from specdec_client.bench import percentile
from specdec_client.bench_prompts import SAMPLINGS
from specdec_client.scrape import Scrape, scrape
from specdec_client.server import DEFAULT_MODEL_REPOSITORY, start_on_free_ports

CHAT_PROMPTS = Path(__file__).resolve().parent / "prompts" / "bench_chat.json"
DECODERS = ("target_model", "eagle_draft", "draft_model")
BATCH_METRIC = "specdec_decoder_executions_total"
STEPS_METRIC = "specdec_decoder_steps_total"
PHASE_METRIC = "specdec_generation_seconds_total"


@dataclass
class Cell:
    mode: str
    sampling: str
    concurrency: int
    requests: int = 0
    output_tokens: int = 0
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    decoders: dict[str, dict[str, Any]] = field(default_factory=dict)
    phases_ms_per_iteration: dict[str, float] = field(default_factory=dict)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def summary(self) -> dict[str, Any]:
        lat = self.latencies_s
        return {"mode": self.mode, "sampling": self.sampling, "concurrency": self.concurrency,
                "requests": self.requests, "output_tokens": self.output_tokens, "wall_s": round(self.wall_s, 2),
                "tok_per_s": round(self.tok_per_s, 1),
                "p50_latency_s": round(statistics.median(lat), 3) if lat else None,
                "p99_latency_s": round(percentile(lat, 99), 3) if lat else None,
                "decoders": self.decoders, "phases_ms_per_iteration": self.phases_ms_per_iteration}


def load_prompts(path: Path = CHAT_PROMPTS) -> list[dict[str, Any]]:
    """Every held-out chat request, domains interleaved: [{prompt, task, max_tokens}]."""
    scenarios = json.loads(path.read_text())["scenarios"]
    per_domain = [[{"prompt": p["prompt"], "task": s["task"]} for p in s["prompts"]] for s in scenarios.values()]
    return [r for group in itertools.zip_longest(*per_domain) for r in group if r is not None]


def batch_distribution(delta: Scrape, model: str) -> dict[str, float]:
    """Share of a decoder's executions per batch-size bucket (`<=N`: at most N steps, more than the bucket
    below)."""
    counts = {int(labels["batch_size"]): value for labels, value in delta.values(BATCH_METRIC, model=model)}
    total = sum(counts.values())
    return {f"<={bound}": round(count / total, 3) for bound, count in sorted(counts.items()) if count} if total else {}


def decoder_figures(delta: Scrape) -> dict[str, dict[str, Any]]:
    figures = {}
    for model in DECODERS:
        executions = delta.total(BATCH_METRIC, model=model)
        steps = delta.total(STEPS_METRIC, model=model)  # a packed request carries a wave of steps
        requests = delta.total("nv_inference_request_success", model=model)
        if not executions:
            continue
        figures[model] = {
            "executions": int(executions), "steps": int(steps), "requests": int(requests),
            "mean_batch": round(steps / executions, 2),
            # Triton credits every request of a batch with the batch's compute time: per request, this is the
            # request-weighted mean duration of an execution.
            "compute_ms_per_execution": round(delta.total("nv_inference_compute_infer_duration_us", model=model)
                                              / max(requests, 1) / 1e3, 2),
            "queue_ms_per_request": round(delta.total("nv_inference_queue_duration_us", model=model)
                                          / max(requests, 1) / 1e3, 2),
            "batch_sizes": batch_distribution(delta, model),
        }
    return figures


def phase_figures(delta: Scrape) -> dict[str, float]:
    iterations = delta.total("specdec_target_calls_total")
    if not iterations:
        return {}
    phases = {labels["phase"]: value for labels, value in delta.values(PHASE_METRIC)}
    return {phase: round(1e3 * seconds / iterations, 2) for phase, seconds in sorted(phases.items())}


def run_cell(url: str, metrics_url: str | None, prompts: list[dict[str, Any]], mode: str, sampling: str,
             concurrency: int, requests: int, max_tokens: int, stream: bool = False) -> Cell:
    cell = Cell(mode, sampling, concurrency)
    queue = iter(range(requests))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(queue, None)
            if i is None:
                return
            request = prompts[i % len(prompts)]
            params = {"text_input": request["prompt"], "max_tokens": max_tokens, "task": request["task"],
                      **SAMPLINGS[sampling]}
            if sampling != "greedy":
                params["seed"] = 1000 + i
            if mode == "plain":
                params["num_draft_tokens"] = 0
            if stream:
                params["stream"] = True
            result = generate_grpc(url, params)
            with lock:
                cell.requests += 1
                cell.output_tokens += int(result.stats.get("num_output_tokens", 0))
                cell.latencies_s.append(result.latency_s)

    before = scrape(metrics_url) if metrics_url else None
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(worker) for _ in range(concurrency)]:
            future.result()
    cell.wall_s = time.perf_counter() - started
    if before is not None:
        delta = scrape(metrics_url) - before
        cell.decoders = decoder_figures(delta)
        cell.phases_ms_per_iteration = phase_figures(delta)
    return cell


def report(cells: list[Cell]) -> str:
    lines = ["| mode | sampling | concurrency | requests | tok/s | P50 s | P99 s | target mean batch | target ms/exec "
             "| target queue ms/request | drafter mean batch |", "|" + " --- |" * 11]
    for cell in cells:
        s = cell.summary()
        target = s["decoders"].get("target_model", {})
        drafter = s["decoders"].get("eagle_draft") or s["decoders"].get("draft_model") or {}
        lines.append(f"| {s['mode']} | {s['sampling']} | {s['concurrency']} | {s['requests']} | {s['tok_per_s']} "
                     f"| {s['p50_latency_s']} | {s['p99_latency_s']} | {target.get('mean_batch', '-')} "
                     f"| {target.get('compute_ms_per_execution', '-')} | {target.get('queue_ms_per_request', '-')} "
                     f"| {drafter.get('mean_batch', '-')} |")
    lines += ["", "Batch sizes of target_model executions (share of executions):", ""]
    for cell in cells:
        target = cell.decoders.get("target_model", {})
        lines.append(f"- {cell.mode} {cell.sampling} c={cell.concurrency}: {target.get('batch_sizes', {})}")
    lines += ["", "Per iteration of speculative_decoding (ms, summed over sequences, per sequence-iteration):", ""]
    for cell in cells:
        if cell.phases_ms_per_iteration:
            lines.append(f"- {cell.mode} {cell.sampling} c={cell.concurrency}: {cell.phases_ms_per_iteration}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="load-profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="gRPC host:port of a running server")
    parser.add_argument("--metrics-url")
    parser.add_argument("--start-server", action="store_true")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--modes", default="plain,speculative")
    parser.add_argument("--sampling", default="greedy", help=f"comma list of {', '.join(SAMPLINGS)}")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--stream", action="store_true", help="stream each answer (a response per iteration)")
    parser.add_argument("--requests", type=int, default=0,
                        help="requests per cell (default: max(12, 2 x concurrency))")
    parser.add_argument("--out", type=Path, default=Path("bench_results/load_profile"))
    args = parser.parse_args(argv)
    prompts = load_prompts()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    modes, samplings = args.modes.split(","), args.sampling.split(",")
    for sampling in samplings:
        if sampling not in SAMPLINGS:
            parser.error(f"--sampling: {sampling!r} is not one of {', '.join(SAMPLINGS)}")
    server = None
    url, metrics_url = args.url, args.metrics_url
    if args.start_server:
        log = Path(tempfile.mkdtemp(prefix="load-profile-")) / "server.log"
        server = start_on_free_ports(args.model_repository, log)
        url, metrics_url = server.grpc_url, server.metrics_url
    if not url:
        parser.error("give --url or --start-server")
    cells: list[Cell] = []
    try:
        generate_grpc(url, {"text_input": prompts[0]["prompt"], "max_tokens": 8})  # warm-up
        for concurrency in concurrencies:
            count = args.requests or max(12, 2 * concurrency)
            for sampling in samplings:
                for mode in modes:
                    cell = run_cell(url, metrics_url, prompts, mode, sampling, concurrency, count, args.max_tokens,
                                    args.stream)
                    cells.append(cell)
                    print(json.dumps(cell.summary()), flush=True)
    finally:
        if server is not None:
            server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps([asdict(c) | c.summary() for c in cells], indent=1))
    text = report(cells)
    (args.out / "results.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
