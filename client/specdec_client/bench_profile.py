"""Where a speculative iteration's time goes, from py-spy samples of the model processes.

Starts a server on free ports, streams one scenario's held-out prompts at concurrency 1 (speculative, or
plain with --plain), and meanwhile samples speculative_decoding, target_model and draft_model with py-spy
(wall clock, idle included). Each process's samples of its serving thread are sorted into categories by
the frames they contain; the table shows milliseconds per target call (= per iteration) using the
server's own call counter, so it adds up with bench's per-iteration split.

    python -m specdec_client.bench_profile --scenario code --seconds 20 --out bench_results/profile
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from specdec_client.api import generate_grpc
from specdec_client.bench_prompts import PROMPTS_FILE
from specdec_client.scrape import scrape
from specdec_client.server import REPO_ROOT, TritonServer, free_port

PROCESSES = ("speculative_decoding", "target_model", "draft_model")
# First match wins, searched from the innermost frame outwards. Frame text is "function (file:line)".
CATEGORIES: dict[str, tuple[tuple[str, str], ...]] = {
    "speculative_decoding": (
        ("detokenization", "detokenize.py"), ("detokenization", "IncrementalDetokenizer"),
        ("acceptance", "acceptance.py"), ("metrics", "metrics.py"),
        ("BLS request/response (tensors)", "bls.py"), ("BLS request/response (tensors)", "tensors.py"),
        ("response send", "chunk_response"), ("response send", ".send"),
        ("drafting/scheduling (core loop)", "specdec/"),
        ("speculative_decoding model.py", "model.py"),
        ("waiting for BLS responses (idle event loop)", "EpollSelector.select"),
        ("asyncio plumbing", "asyncio/"),
    ),
    "target_model": (
        ("forward (runtime: torch or onnxruntime)", "runtime/"), ("engine (slots, batching)", "engines.py"),
        ("engine (slots, batching)", "kv_cache.py"), ("tensor I/O (decoder adapter)", "decoder.py"),
        ("metrics", "metrics.py"),
    ),
}
CATEGORIES["draft_model"] = CATEGORIES["target_model"]


def stub_pids(server: TritonServer) -> dict[str, int]:
    import psutil

    pids = {}
    for child in psutil.Process(server.process.pid).children(recursive=True):
        command = " ".join(child.cmdline())
        for name in PROCESSES:
            if f"/{name}/" in command:
                pids[name] = child.pid
    return pids


def classify(stack: str, process: str) -> str | None:
    """The category of one collapsed stack; None for threads that are not the model's serving thread."""
    frames = stack.split(";")
    if process == "speculative_decoding" and not any("run_forever" in f for f in frames):
        return None  # the stub's executor threads block in C++ while a BLS call is in flight
    if process != "speculative_decoding" and any("Thread._bootstrap" in f for f in frames):
        return None  # not the stub's main thread (e.g. the memory sampler sleeping in specdec.metrics)
    for frame in reversed(frames):
        for category, needle in CATEGORIES[process]:
            if needle in frame:
                return category
    if process != "speculative_decoding" and (not frames or frames == [""]):
        return "idle (waiting for the next execute)"
    return "other Python"


def summarize(raw: Path, process: str) -> collections.Counter:
    counts: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        category = classify(stack, process)
        if category is not None and count.isdigit():
            counts[category] += int(count)
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default="code", choices=("json", "code", "prose"))
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--plain", action="store_true", help="profile plain decoding instead")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "profile")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    scenario = json.loads(PROMPTS_FILE.read_text())["scenarios"][args.scenario]
    py_spy = Path(sys.executable).parent / "py-spy"
    server = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          log_file=args.out / "server.log")
    with server:
        pids = stub_pids(server)
        params = {"max_tokens": scenario["max_tokens"], "stream": True, "task": scenario["task"]}
        if args.plain:
            params["num_draft_tokens"] = 0
        generate_grpc(server.grpc_url, {**params, "text_input": scenario["prompts"][0]["prompt"]})  # warm up
        stop = threading.Event()
        served = {"requests": 0}

        def load() -> None:
            i = 0
            while not stop.is_set():
                generate_grpc(server.grpc_url, {**params, "text_input": scenario["prompts"][i % 16]["prompt"]})
                served["requests"] += 1
                i += 1

        before = scrape(server.metrics_url)
        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        time.sleep(0.5)
        spies = {name: subprocess.Popen([str(py_spy), "record", "--pid", str(pid), "--rate", str(args.rate),
                                         "--duration", str(int(args.seconds)), "--idle", "--format", "raw",
                                         "--output", str(args.out / f"{name}.txt")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                 for name, pid in pids.items()}
        for spy in spies.values():
            spy.wait()
        delta = scrape(server.metrics_url) - before
        stop.set()
        worker.join()
    # Calls over the whole load window approximate those of the sampled window (it is most of it).
    window = args.seconds + 0.5
    task = {"model": "speculative_decoding", "task": scenario["task"]}
    target_calls = delta.total("specdec_target_calls_total", **task) * args.seconds / window
    report = {"scenario": args.scenario, "mode": "plain" if args.plain else "speculative", "seconds": args.seconds,
              "target_calls_sampled": target_calls, "processes": {}}
    lines = [f"# py-spy: {report['mode']} {args.scenario}, concurrency 1, {args.seconds:.0f} s "
             f"(~{target_calls:.0f} target calls)", ""]
    for name in pids:
        counts = summarize(args.out / f"{name}.txt", name)
        total = sum(counts.values())
        rows = {category: {"share": n / total, "ms_per_target_call": 1e3 * args.seconds * n / total / target_calls}
                for category, n in counts.most_common()} if total and target_calls else {}
        report["processes"][name] = rows
        lines += [f"## {name}", "", "| category | share of wall time | ms per target call |", "|---|---:|---:|"]
        lines += [f"| {c} | {r['share']:.1%} | {r['ms_per_target_call']:.2f} |" for c, r in rows.items()] + [""]
    (args.out / "profile.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "profile.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
