"""`bench`: speculative vs plain decoding through one server, with Hugging Face peers, in one run.

The article's three scenarios (JSON 128 new tokens, code 256, prose 512) on held-out prompts
(`prompts/bench.json`); a concurrency sweep; plain (num_draft_tokens 0) and speculative requests to the same
server, same models and prompts, interleaved in alternating order (ABBA) so drift hits both alike. At
concurrency 1 the same run also times Hugging Face transformers on the same checkpoints and prompts: plain
greedy `generate`, assisted generation (`assistant_model`) with its default schedule, with a fixed k, and
prompt lookup decoding (`prompt_lookup_num_tokens`).

Each scenario runs greedy and, with `--sampling`, sampled (temperature 0.7 / top_p 0.95 `t0.7`, temperature
1.0 `t1.0`), each sampled request with its own seed; "speculative" is what the default profiles do with the
request (they decode a sampled request plain unless it names a speculation option); `--drafters` adds modes that
force a drafter. How repetitive the answers were is reported per cell (`repeated_share`: the share of an
answer's words inside a word 4-gram that occurs 3 or more times in it; an answer at 0.3 or more counts as
looping), and the speedup over the pairs of answers neither of which loops beside the overall one: a 135M
model loops under greedy decoding and prompt lookup proposes a loop for free.

Per cell: req/s, tok/s, P50/P99 latency, P50/P99 time to first token, inter-token latency
((latency - TTFT) / (tokens - 1), as genai-perf), alpha (accepted / proposed draft tokens, from the
responses), tau (tokens per verification pass), mean k, and from the server's /metrics the per-call compute
time of the draft and target models, from which c, v and the model bound tau / (k c + v) follow
(docs/BENCHMARKS.md, "What is measured"). Memory: the draft model's process USS (what loading it costs) over
the rest of the serving footprint (PSS of every server process when bench started the server, else of the
reporting ones), and KV-cache bytes.

Writes results.json, results.md, speedup.png and throughput.png into --out; shows a progress bar.

    bench --start-server                       # everything on a fresh local server
    bench --url 127.0.0.1:8001 --metrics-url http://127.0.0.1:8002/metrics --concurrency 1 --no-hf
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec_client.api import generate_grpc
from specdec_client.bench_prompts import PROMPTS_FILE, SAMPLINGS
from specdec_client.scrape import Scrape, scrape
from specdec_client.server import DRAFTER_MODELS, REPO_ROOT, TritonServer, free_port, model_processes

PLAIN, SPECULATIVE = "plain", "speculative"
DRAFTER_MODE_PREFIX = "speculative-"  # `--drafters model,eagle`: one speculative mode per drafter
HF_GREEDY, HF_ASSISTED, HF_ASSISTED_K = "hf_greedy", "hf_assisted_default", "hf_assisted_k"
HF_LOOKUP = "hf_prompt_lookup"  # transformers' prompt lookup decoding (prompt_lookup_num_tokens)
HF_LOOKUP_TOKENS = 10  # transformers' documented example value
SERVER_MODES = (PLAIN, SPECULATIVE)
HF_MODES = (HF_GREEDY, HF_ASSISTED, HF_ASSISTED_K, HF_LOOKUP)
DEFAULT_CONCURRENCY = (1, 4, 16)
# Targets of the real-model and EAGLE issues (benchmark figures, not test assertions).
TARGET_SPEEDUP = {"json": 3.0, "code": 2.5, "prose": 2.0}  # the real-model issues' targets
TARGET_OVER_HF_ASSISTED = 1.5
GREEDY = "greedy"
REPEAT_NGRAM, REPEAT_TIMES = 4, 3  # a word 4-gram that occurs 3 or more times in an answer is a repeat
LOOPING_SHARE = 0.3  # an answer with this share of its words inside repeats or more loops


def repeated_share(text: str) -> float:
    """The share of `text`'s words inside a word REPEAT_NGRAM-gram that occurs REPEAT_TIMES or more times in it."""
    words = text.split()
    grams = [tuple(words[i:i + REPEAT_NGRAM]) for i in range(len(words) - REPEAT_NGRAM + 1)]
    counts: dict[tuple[str, ...], int] = {}
    for gram in grams:
        counts[gram] = counts.get(gram, 0) + 1
    covered = [False] * len(words)
    for i, gram in enumerate(grams):
        if counts[gram] >= REPEAT_TIMES:
            covered[i:i + REPEAT_NGRAM] = [True] * REPEAT_NGRAM
    return sum(covered) / len(words) if words else 0.0


def label_of(scenario: str, sampling: str) -> str:
    """A cell's scenario label: the scenario, with its sampling after it unless greedy ("json t0.7")."""
    return scenario if sampling == GREEDY else f"{scenario} {sampling}"


def is_greedy(label: str) -> bool:
    return len(label.split()) == 1
TARGET_BOUND_FRACTION = 0.9
TARGET_MEMORY_OVERHEAD = 0.15  # the real-model issue: speculation costs at most 15% more memory


@dataclass
class Record:
    """One request as the client saw it."""

    scenario: str
    mode: str
    concurrency: int
    round: int
    prompt: int
    latency_s: float
    ttft_s: float | None
    output_tokens: int
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    text: str = ""
    error: str | None = None
    fallback: bool = False  # the response said the task's profile had fallen back to plain decoding


@dataclass
class Cell:
    """All requests of one (scenario, mode, concurrency) with their aggregate figures."""

    scenario: str
    mode: str
    concurrency: int
    records: list[Record] = field(default_factory=list)
    wall_s: float = 0.0
    server: dict[str, float] = field(default_factory=dict)  # summed /metrics differences of its batches

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.records if r.error is None]
        tokens = sum(r.output_tokens for r in ok)
        latencies = [r.latency_s for r in ok]
        ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
        itls = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
                if r.ttft_s is not None and r.output_tokens > 1]
        proposed = sum(r.draft_tokens for r in ok)
        accepted = sum(r.accepted_draft_tokens for r in ok)
        out: dict[str, Any] = {
            "scenario": self.scenario, "mode": self.mode, "concurrency": self.concurrency,
            "requests": len(ok), "errors": len(self.records) - len(ok), "output_tokens": tokens,
            "wall_s": self.wall_s,
            "req_per_s": len(ok) / self.wall_s if self.wall_s else None,
            "tok_per_s": tokens / self.wall_s if self.wall_s else None,
            "latency_p50_s": percentile(latencies, 50), "latency_p99_s": percentile(latencies, 99),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "itl_mean_s": statistics.fmean(itls) if itls else None, "itl_p50_s": percentile(itls, 50),
            "alpha": accepted / proposed if proposed else None,
            "fallback_share": sum(r.fallback for r in ok) / len(ok) if ok else None,
            "repeated_share": statistics.fmean(repeated_share(r.text) for r in ok) if ok else None,
            "looping_requests": sum(repeated_share(r.text) >= LOOPING_SHARE for r in ok),
        }
        s = self.server
        passes = s.get("passes", 0.0)
        if passes:
            out["tau"] = (s["accepted"] + passes) / passes
            out["k_mean"] = s["proposed"] / passes
        if s.get("target_calls"):
            out["target_ms_per_call"] = s["target_compute_us"] / s["target_calls"] / 1e3
            out["target_queue_ms_per_call"] = s["target_queue_us"] / s["target_calls"] / 1e3
            out["iteration_ms"] = 1e3 * sum(latencies) / s["target_calls"] if self.concurrency == 1 else None
        if s.get("draft_calls"):
            out["draft_ms_per_call"] = s["draft_compute_us"] / s["draft_calls"] / 1e3
            out["draft_queue_ms_per_call"] = s["draft_queue_us"] / s["draft_calls"] / 1e3
        return out


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default) of a small sample."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# ------------------------------------------------------------------------------------------- server side
SERVER_COUNTERS = {
    "passes": ("specdec_verification_passes_total", {}),
    "proposed": ("specdec_draft_tokens_total", {}),
    "accepted": ("specdec_accepted_draft_tokens_total", {}),
    "target_calls": ("specdec_target_calls_total", {}),
    "draft_calls": ("specdec_draft_calls_total", {}),
    "target_compute_us": ("nv_inference_compute_infer_duration_us", {"model": "target_model"}),
    "draft_compute_us": ("nv_inference_compute_infer_duration_us", {"model": "draft_model"}),
    "target_queue_us": ("nv_inference_queue_duration_us", {"model": "target_model"}),
    "draft_queue_us": ("nv_inference_queue_duration_us", {"model": "draft_model"}),
    # The EAGLE head's calls are draft calls too (a cell runs one drafter, so the sums are that drafter's).
    "eagle_compute_us": ("nv_inference_compute_infer_duration_us", {"model": "eagle_draft"}),
    "eagle_queue_us": ("nv_inference_queue_duration_us", {"model": "eagle_draft"}),
}


def server_modes(drafters: list[str]) -> tuple[str, ...]:
    """Plain, then the profile's speculation (no drafters named) or one speculative mode per drafter."""
    return (PLAIN, *(f"{DRAFTER_MODE_PREFIX}{d}" for d in drafters)) if drafters else SERVER_MODES


def is_speculative(mode: str) -> bool:
    return mode == SPECULATIVE or mode.startswith(DRAFTER_MODE_PREFIX)


def server_deltas(delta: Scrape, task: str) -> dict[str, float]:
    out = {}
    for key, (name, labels) in SERVER_COUNTERS.items():
        match = labels if labels else {"model": "speculative_decoding", "task": task}
        out[key] = delta.total(name, **match)
    out["draft_compute_us"] += out.pop("eagle_compute_us")
    out["draft_queue_us"] += out.pop("eagle_queue_us")
    return out


def run_server_batch(url: str, prompts: list[str], params: dict[str, Any], concurrency: int,
                     on_done: Callable[[], None], seeded: bool = False
                     ) -> tuple[list[tuple[int, Any, str | None, float]], float]:
    """Send every prompt once with `concurrency` requests in flight (`seeded`: prompt i with seed 1000 + i, the
    same in every mode); returns per-prompt results and wall time."""
    results: list[tuple[int, Any, str | None, float]] = []
    lock = threading.Lock()
    queue = iter(range(len(prompts)))

    def worker() -> None:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(url)
        try:
            while True:
                with lock:
                    index = next(queue, None)
                if index is None:
                    return
                started = time.perf_counter()
                try:
                    seed = {"seed": 1000 + index} if seeded else {}
                    result = generate_grpc(url, {**params, **seed, "text_input": prompts[index]}, client=client)
                    item = (index, result, None, time.perf_counter() - started)
                except Exception as exc:  # recorded, not fatal: the table shows the error count
                    item = (index, None, f"{type(exc).__name__}: {exc}", time.perf_counter() - started)
                with lock:
                    results.append(item)
                on_done()
        finally:
            client.close()

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for future in [pool.submit(worker) for _ in range(concurrency)]:
            future.result()
    return results, time.perf_counter() - started


# ------------------------------------------------------------------------------------------- HF peer
class HfPeer:
    """transformers generate on the served checkpoints: greedy, assisted (default schedule), assisted fixed k."""

    def __init__(self, repository: Path, fixed_k: int, threads: int) -> None:
        import torch
        from transformers import AutoTokenizer, LlamaForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        target_dir, draft_dir = repository / "target_model" / "1", repository / "draft_model" / "1"
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)
        load = lambda d: LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()  # noqa: E731
        self.target = load(target_dir)
        # Separate assistants: the default schedule adapts state across calls; the fixed-k one must not.
        self.assistant_default = load(draft_dir)
        self.assistant_fixed = load(draft_dir)
        config = self.assistant_fixed.generation_config
        config.num_assistant_tokens = fixed_k
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0  # always propose k tokens
        self.fixed_k = fixed_k
        self.threads = threads

    def describe(self) -> dict[str, Any]:
        from transformers import GenerationConfig

        defaults = GenerationConfig._get_default_generation_params()
        own = self.assistant_default.generation_config
        keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
        default = {key: getattr(own, key, None) if getattr(own, key, None) is not None else defaults.get(key)
                   for key in keys}
        return {"default_schedule": default, "fixed_k": self.fixed_k, "torch_threads": self.threads,
                "dtype": "float32", "prompt_lookup_num_tokens": HF_LOOKUP_TOKENS}

    def generate(self, prompt: str, max_tokens: int, mode: str) -> tuple[float, int, str]:
        ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        kwargs: dict[str, Any] = {"max_new_tokens": max_tokens, "do_sample": False,
                                  "pad_token_id": self.tokenizer.pad_token_id}
        if mode == HF_ASSISTED:
            kwargs["assistant_model"] = self.assistant_default
        elif mode == HF_ASSISTED_K:
            kwargs["assistant_model"] = self.assistant_fixed
        elif mode == HF_LOOKUP:
            kwargs["prompt_lookup_num_tokens"] = HF_LOOKUP_TOKENS
        started = time.perf_counter()
        with self.torch.inference_mode():
            out = self.target.generate(ids, **kwargs)
        latency = time.perf_counter() - started
        new = out[0, ids.shape[1]:]
        eos = self.target.generation_config.eos_token_id
        count = int(sum(1 for t in new.tolist() if t != eos))
        return latency, count, self.tokenizer.decode(new, skip_special_tokens=True)


# ------------------------------------------------------------------------------------------- memory
GPU_MODELS = ("target_model", "draft_model", "eagle_draft")  # the decoders a GPU deployment places on GPUs


def parse_compute_apps(text: str) -> dict[int, int]:
    """pid -> GPU bytes from `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`
    (MiB; a process on several GPUs is summed)."""
    used: dict[int, int] = {}
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit():
            used[int(fields[0])] = used.get(int(fields[0]), 0) + int(fields[1]) * 2**20
    return used


def gpu_memory_per_model(instances: dict[str, int], used: dict[int, int]) -> dict[str, int]:
    """GPU bytes per decoder model from its instances' processes (instance names such as draft_model_0_2)."""
    per_model: dict[str, int] = {}
    for instance, pid in instances.items():
        model = next((m for m in GPU_MODELS if instance.startswith(m + "_")), None)
        if model is not None and pid in used:
            per_model[model] = per_model.get(model, 0) + used[pid]
    return per_model


def gpu_memory(server: TritonServer) -> dict[str, Any] | None:
    """GPU memory of the decoders' processes (None without nvidia-smi, or where it shows no pid of ours,
    as in containers that hide host pids): the drafters' share is speculation's GPU memory cost."""
    if server.process is None:
        return None
    try:
        listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, check=False, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    per_model = gpu_memory_per_model(model_processes(server.process.pid), parse_compute_apps(listed.stdout))
    if not per_model.get("target_model"):
        return None
    drafters = sum(v for m, v in per_model.items() if m != "target_model")
    return {"per_model_bytes": per_model, "drafters_overhead_fraction": drafters / per_model["target_model"]}


def server_memory(metrics: Scrape, server: TritonServer | None) -> dict[str, Any]:
    """Memory cost of speculation: the loaded drafter processes' USS (what unloading them frees) over the rest
    of the serving footprint, together as `overhead_fraction` (what this deployment pays) and each alone (what
    a repository holding only that drafter model pays)."""
    per_model = {}
    for model in ("target_model", *DRAFTER_MODELS, "speculative_decoding"):
        per_model[model] = {kind: metrics.total(f"specdec_{kind}_memory_bytes", model=model)
                            for kind in ("resident", "proportional", "unique")}
        per_model[model]["kv_cache_bytes"] = metrics.total("specdec_kv_cache_bytes", model=model)
    out: dict[str, Any] = {"per_model": per_model}
    if server is not None and server.process is not None:
        import psutil

        root = psutil.Process(server.process.pid)
        processes = [root, *root.children(recursive=True)]
        total = 0
        for process in processes:
            try:
                total += process.memory_full_info().pss
            except (psutil.Error, AttributeError):
                total += process.memory_info().rss
        out["footprint_source"] = f"PSS of all {len(processes)} server processes (tritonserver and model stubs)"
    else:
        total = sum(v["proportional"] for v in per_model.values())
        out["footprint_source"] = "PSS of the processes that report specdec_* memory (target, draft, speculative)"
    drafters = {model: per_model[model]["unique"] for model in DRAFTER_MODELS if per_model[model]["unique"] > 0}
    without = total - sum(drafters.values())
    out["footprint_bytes"] = total
    out["drafters_loaded"] = sorted(drafters)
    out["overhead_fraction"] = sum(drafters.values()) / without if drafters and without > 0 else None
    out["overhead_fraction_each"] = {model: uss / without for model, uss in drafters.items()} if without > 0 else {}
    kv_t = per_model["target_model"]["kv_cache_bytes"]
    kv_d = sum(per_model[model]["kv_cache_bytes"] for model in drafters)
    out["kv_cache_overhead_fraction"] = kv_d / kv_t if kv_t else None
    if server is not None and gpu_names():
        out["gpu"] = gpu_memory(server)
    return out


# ------------------------------------------------------------------------------------------- reporting
def gpu_names() -> list[str]:
    """The GPUs nvidia-smi lists (none on a CPU machine)."""
    with suppress(OSError, subprocess.SubprocessError):
        listed = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, check=False, timeout=10)
        if listed.returncode == 0:
            return [line.strip() for line in listed.stdout.splitlines() if line.strip()]
    return []


def served_runtime(pbtxt: Path) -> dict[str, str | None]:
    """The runtime, weight quantization and instance kind a rendered config.pbtxt gives its decoder."""
    text = pbtxt.read_text() if pbtxt.exists() else ""
    runtime = re.search(r'key: "runtime"\s*value \{\s*string_value: "(\w+)"', text)
    weights = re.search(r'key: "weight_quantization"\s*value \{\s*string_value: "(\w+)"', text)
    kind = re.search(r"kind: (KIND_\w+)", text)
    return {"runtime": runtime.group(1) if runtime else None, "kind": kind.group(1) if kind else None,
            "weight_quantization": weights.group(1) if weights else None}


def machine_info(model_repository: Path = REPO_ROOT / "model_repository") -> dict[str, Any]:
    """The machine, and the decoders of the repository served (their shapes, runtime and placement)."""
    cpu = ""
    with suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    commit = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    models = {}
    for name in ("target_model", "draft_model", "eagle_draft"):
        config_path = model_repository / name / "1" / "config.json"
        if config_path.exists():
            config = json.loads(config_path.read_text())
            models[name] = {k: config.get(k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                        "num_attention_heads", "vocab_size")}
            models[name].update(served_runtime(model_repository / name / "config.pbtxt"))
    return {"cpu": cpu, "cores": os.cpu_count(), "gpus": gpu_names(), "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average": os.getloadavg(), "git_commit": commit, "models": models,
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _fmt(value: Any, scale: float = 1.0, digits: int = 1) -> str:
    return "–" if value is None else f"{value * scale:.{digits}f}"


def not_looping_speedup(cells: dict[tuple[str, str, int], Cell], label: str, mode: str) -> dict[str, Any]:
    """At concurrency 1: `mode`'s speedup over plain decoding on the requests (same prompt, same round) where
    neither answer loops (repeated_share below LOOPING_SHARE), and how many such pairs there were."""
    plain, spec = cells.get((label, PLAIN, 1)), cells.get((label, mode, 1))
    if plain is None or spec is None:
        return {}
    by_request = {(r.round, r.prompt): r for r in plain.records if r.error is None}
    pairs = [(by_request[(r.round, r.prompt)], r) for r in spec.records
             if r.error is None and (r.round, r.prompt) in by_request]
    kept = [(p, r) for p, r in pairs if max(repeated_share(p.text), repeated_share(r.text)) < LOOPING_SHARE]
    if not kept:
        return {"not_looping_pairs": 0, "pairs": len(pairs)}
    rate = lambda records: sum(r.output_tokens for r in records) / sum(r.latency_s for r in records)  # noqa: E731
    return {"speedup_not_looping": rate([r for _, r in kept]) / rate([p for p, _ in kept]),
            "not_looping_pairs": len(kept), "pairs": len(pairs)}


def derived(summaries: list[dict[str, Any]], scenarios: list[str],
            not_looping: dict[tuple[str, str], dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """Ratios from the same run: speedup, ours over HF, model bound (c, v), per-iteration time split, and the
    speedup on answers that do not loop (`not_looping`, per scenario label and mode)."""
    by = {(s["scenario"], s["mode"], s["concurrency"]): s for s in summaries}
    modes = list(dict.fromkeys(s["mode"] for s in summaries if is_speculative(s["mode"])))
    out: dict[str, dict[str, Any]] = {}
    for scenario, mode in ((scenario, mode) for scenario in scenarios for mode in modes):
        plain, spec = by.get((scenario, PLAIN, 1)), by.get((scenario, mode, 1))
        if not plain or not spec or not plain.get("tok_per_s") or not spec.get("tok_per_s"):
            continue
        row: dict[str, Any] = {"speedup": spec["tok_per_s"] / plain["tok_per_s"],
                               "p99_latency_ratio": (spec["latency_p99_s"] or 0) / (plain["latency_p99_s"] or 1)}
        for peer_mode in HF_MODES:
            peer = by.get((scenario, peer_mode, 1))
            if peer and peer.get("tok_per_s"):
                row[f"over_{peer_mode}"] = spec["tok_per_s"] / peer["tok_per_s"]
        t1 = plain.get("target_ms_per_call")
        if t1 and spec.get("k_mean") and spec.get("draft_ms_per_call") and spec.get("tau"):
            c = spec["draft_ms_per_call"] / spec["k_mean"] / t1
            v = spec["target_ms_per_call"] / t1
            bound = spec["tau"] / (spec["k_mean"] * c + v)
            row.update({"c": c, "v": v, "model_bound": bound, "fraction_of_bound": row["speedup"] / bound})
        if spec.get("iteration_ms"):
            # Draft calls per target call < 1: the prefill and the last steps run without a draft.
            ratio = spec.get("draft_calls_per_target_call", 0.0)
            parts = {"draft_compute_ms": (spec.get("draft_ms_per_call") or 0.0) * ratio,
                     "target_compute_ms": spec.get("target_ms_per_call") or 0.0,
                     "queue_ms": (spec.get("target_queue_ms_per_call") or 0.0)
                     + (spec.get("draft_queue_ms_per_call") or 0.0) * ratio}
            parts["other_ms"] = spec["iteration_ms"] - sum(parts.values())
            row["iteration_ms"] = spec["iteration_ms"]
            row["iteration_split_ms"] = parts
            row["plain_step_ms"] = plain.get("iteration_ms")
        row["alpha"], row["tau"] = spec.get("alpha"), spec.get("tau")
        row.update((not_looping or {}).get((scenario, mode), {}))
        out[scenario if mode == SPECULATIVE else f"{scenario} {mode}"] = row
    return out


def markdown(results: dict[str, Any]) -> str:
    summaries, ratios = results["cells"], results["derived"]
    lines = [f"# bench results ({results['machine']['time_utc']}, commit {results['machine']['git_commit']})", "",
             f"Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores; load average at start "
             f"{results['machine']['load_average'][0]:.2f}"
             + (f"; GPU: {', '.join(results['machine']['gpus'])}" if results["machine"].get("gpus") else "")
             + ". Models: " + ", ".join(
                 f"{n} {m['num_hidden_layers']}x{m['hidden_size']} ({m.get('runtime')}"
                 f"{', ' + m['kind'] if m.get('kind') else ''})"
                for n, m in results["machine"]["models"].items()),
             "", "## Throughput and latency", "",
             "| scenario | mode | conc. | req | req/s | tok/s | P50 lat s | P99 lat s | P50 TTFT ms | P99 TTFT ms "
             "| ITL ms | α | τ | k | fallback | repeated (looping) | speedup |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    plain_tps = {(s["scenario"], s["concurrency"]): s["tok_per_s"] for s in summaries if s["mode"] == PLAIN}
    for s in summaries:
        base = plain_tps.get((s["scenario"], s["concurrency"])) if s["mode"] != PLAIN else None
        if s["mode"] in HF_MODES:
            base = plain_tps.get((s["scenario"], 1))
        speedup = s["tok_per_s"] / base if base and s["tok_per_s"] else None
        lines.append(
            f"| {s['scenario']} | {s['mode']} | {s['concurrency']} | {s['requests']}"
            f"{'' if not s['errors'] else ' (' + str(s['errors']) + ' err)'} | {_fmt(s['req_per_s'], digits=2)} "
            f"| {_fmt(s['tok_per_s'])} | {_fmt(s['latency_p50_s'], digits=2)} | {_fmt(s['latency_p99_s'], digits=2)} "
            f"| {_fmt(s['ttft_p50_s'], 1e3)} | {_fmt(s['ttft_p99_s'], 1e3)} | {_fmt(s['itl_mean_s'], 1e3, 2)} "
            f"| {_fmt(s['alpha'], digits=2)} | {_fmt(s.get('tau'), digits=2)} | {_fmt(s.get('k_mean'), digits=1)} "
            f"| {_fmt(s['fallback_share'], 100, 0) + '%' if is_speculative(s['mode']) else '–'} "
            f"| {_fmt(s.get('repeated_share'), 100, 0)}% ({s.get('looping_requests', 0)}) "
            f"| {_fmt(speedup, digits=2)}{'×' if speedup else ''} |")
    lines += ["", "Speedup: tok/s over plain decoding through the same server at the same concurrency (HF rows: "
              "over our plain decoding at concurrency 1). fallback: share of speculative requests whose task profile "
              "had fallen back to plain decoding (acceptance below the profile's floor). repeated: the mean share "
              f"of an answer's words inside a word {REPEAT_NGRAM}-gram that occurs {REPEAT_TIMES} or more times "
              f"in it; in brackets the answers at {LOOPING_SHARE:.0%} or more (looping). Sampled cells (t0.7: "
              "temperature 0.7, top_p 0.95; t1.0: temperature 1.0) send each request with its own seed.", "",
              "## Targets (concurrency 1)", "",
              "| scenario | speedup (target) | α | τ | ours / HF assisted default | ours / HF assisted k "
              "| ours / HF prompt lookup | ours / HF greedy | c | v | bound τ/(kc+v) | speedup / bound "
              "| P99 spec / plain | speedup without looping answers (pairs) |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for scenario, r in ratios.items():
        lines.append(
            f"| {scenario} | {_fmt(r['speedup'], digits=2)}× ({TARGET_SPEEDUP.get(scenario.split()[0], 0):.1f}×) "
            f"| {_fmt(r.get('alpha'), digits=2)} | {_fmt(r.get('tau'), digits=2)} "
            f"| {_fmt(r.get('over_' + HF_ASSISTED), digits=2)} | {_fmt(r.get('over_' + HF_ASSISTED_K), digits=2)} "
            f"| {_fmt(r.get('over_' + HF_LOOKUP), digits=2)} "
            f"| {_fmt(r.get('over_' + HF_GREEDY), digits=2)} | {_fmt(r.get('c'), digits=3)} "
            f"| {_fmt(r.get('v'), digits=2)} "
            f"| {_fmt(r.get('model_bound'), digits=2)} | {_fmt(r.get('fraction_of_bound'), 100, 0)}% "
            f"| {_fmt(r['p99_latency_ratio'], digits=2)} "
            f"| {_fmt(r.get('speedup_not_looping'), digits=2)}{'×' if r.get('speedup_not_looping') else ''} "
            f"({r.get('not_looping_pairs', 0)} of {r.get('pairs', 0)}) |")
    split = {s: r["iteration_split_ms"] for s, r in ratios.items() if r.get("iteration_split_ms")}
    if split:
        lines += ["", "## Where an iteration's time goes (speculative, concurrency 1, ms per target call)", "",
                  "| scenario | iteration | draft compute | target compute | sequence-batcher queues | other (BLS, "
                  "loop, acceptance, detokenization, streaming) | plain step |", "|---|---:|---:|---:|---:|---:|---:|"]
        for scenario, parts in split.items():
            r = ratios[scenario]
            lines.append(f"| {scenario} | {r['iteration_ms']:.2f} | {parts['draft_compute_ms']:.2f} "
                         f"| {parts['target_compute_ms']:.2f} | {parts['queue_ms']:.2f} | {parts['other_ms']:.2f} "
                         f"| {_fmt(r.get('plain_step_ms'), digits=2)} |")
    memory = results.get("memory")
    if memory:
        pm = memory["per_model"]
        loaded = memory.get("drafters_loaded") or []
        each = memory.get("overhead_fraction_each") or {}
        lines += ["", "## Memory", "",
                  f"The drafter processes loaded ({', '.join(loaded) or 'none'}): USS "
                  f"{sum(pm[m]['unique'] for m in loaded) / 2**20:.0f} MiB over a serving footprint of "
                  f"{(memory['footprint_bytes'] - sum(pm[m]['unique'] for m in loaded)) / 2**20:.0f} MiB without them "
                  f"({memory['footprint_source']}): overhead **{_fmt(memory['overhead_fraction'], 100)}%** (target ≤ "
                  f"{TARGET_MEMORY_OVERHEAD:.0%})"
                  + ("; each alone (a repository holding only that drafter model): "
                     + ", ".join(f"{m} {_fmt(f, 100)}%" for m, f in each.items()) if len(each) > 1 else "")
                  + f". KV cache: drafters {sum(pm[m]['kv_cache_bytes'] for m in loaded) / 2**20:.0f} MiB vs target "
                  f"{pm['target_model']['kv_cache_bytes'] / 2**20:.0f} MiB "
                  f"({_fmt(memory['kv_cache_overhead_fraction'], 100)}%).", "",
                  "| process | RSS MiB | PSS MiB | USS MiB | KV cache MiB |", "|---|---:|---:|---:|---:|"]
        for model, v in pm.items():
            lines.append(f"| {model} | {v['resident'] / 2**20:.0f} | {v['proportional'] / 2**20:.0f} "
                         f"| {v['unique'] / 2**20:.0f} | {v['kv_cache_bytes'] / 2**20:.0f} |")
        if "gpu" in memory:  # on a GPU machine the figures above are host memory, CUDA contexts included
            gpu = memory["gpu"]
            lines += ["", "The figures above are host memory. GPU memory (nvidia-smi, per decoder's processes): " + (
                ", ".join(f"{m} {b / 2**20:.0f} MiB" for m, b in gpu["per_model_bytes"].items())
                + f"; the drafters' processes are **{gpu['drafters_overhead_fraction']:.0%}** of the target's"
                if gpu else "not attributable (nvidia-smi shows none of the server's processes).")]
    if results.get("fidelity"):
        lines += ["", "## Fidelity (greedy): outputs equal to our plain decoding", ""]
        lines += [f"- {mode}: {v['equal']}/{v['compared']}" for mode, v in results["fidelity"].items()]
        for m in results.get("fidelity_mismatches") or []:
            lines += [f"- differs: {m['scenario']} request {m['prompt']}, {m['mode']} at concurrency "
                      f"{m['concurrency']}, from character {m['first_difference_char']}: plain "
                      f"{json.dumps(m['plain'])} / speculative {json.dumps(m['speculative'])}"]
    return "\n".join(lines) + "\n"


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = results["cells"]
    scenarios = list(dict.fromkeys(s["scenario"] for s in summaries))
    by = {(s["scenario"], s["mode"], s["concurrency"]): s for s in summaries}
    written = []
    fig, ax = plt.subplots(figsize=(8, 4.5))
    speculative = list(dict.fromkeys(s["mode"] for s in summaries if is_speculative(s["mode"])))
    modes = [*speculative, *[m for m in HF_MODES if any(k[1] == m for k in by)]]
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        values = []
        for scenario in scenarios:
            plain, cell = by.get((scenario, PLAIN, 1)), by.get((scenario, mode, 1))
            values.append(cell["tok_per_s"] / plain["tok_per_s"] if plain and cell and plain["tok_per_s"] else 0)
        bars = ax.bar([x + i * width for x in range(len(scenarios))], values, width, label=mode)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    for x, scenario in enumerate(scenarios):
        if scenario in TARGET_SPEEDUP:
            ax.hlines(TARGET_SPEEDUP[scenario], x - width / 2, x + width * (len(modes) - 0.5), colors="red",
                      linestyles="dashed", label="target" if x == 0 else None)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(scenarios))], scenarios)
    ax.set_ylabel("tokens/s over our plain decoding (concurrency 1)")
    ax.set_title("Speedup per scenario")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out / "speedup.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(scenarios), figsize=(4 * len(scenarios), 4), squeeze=False)
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        for mode in [PLAIN, *speculative]:
            points = sorted((s["concurrency"], s["tok_per_s"]) for s in summaries
                            if s["scenario"] == scenario and s["mode"] == mode and s["tok_per_s"])
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tokens/s")
        ax.set_title(scenario)
        ax.legend(fontsize=8)
    fig.suptitle("Throughput vs concurrency")
    fig.tight_layout()
    written.append(out / "throughput.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


# ------------------------------------------------------------------------------------------- driver
@contextmanager
def server_for(args: argparse.Namespace) -> Iterator[tuple[str, str, TritonServer | None]]:
    if not args.start_server:
        yield args.url, args.metrics_url, None
        return
    server = TritonServer(model_repository=args.model_repository, http_port=free_port(), grpc_port=free_port(),
                          metrics_port=free_port(), log_file=args.out / "server.log")
    with server:
        yield server.grpc_url, server.metrics_url, server


def load_prompts(path: Path, scenarios: list[str], count: int) -> dict[str, dict[str, Any]]:
    document = json.loads(path.read_text())["scenarios"]
    return {name: {**document[name], "prompts": [p["prompt"] for p in document[name]["prompts"]][:count]}
            for name in scenarios}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm

    scenarios = load_prompts(args.prompts, args.scenarios, args.prompts_per_scenario)
    cells: dict[tuple[str, str, int], Cell] = {}
    hf = None if args.no_hf else HfPeer(args.model_repository, args.hf_fixed_k, args.hf_threads)

    def requests_per_cell(concurrency: int, n_prompts: int) -> int:
        return max(n_prompts, concurrency) if concurrency > 1 else n_prompts

    modes = server_modes(args.drafters)
    samplings = args.sampling
    total = sum(args.rounds * requests_per_cell(c, len(s["prompts"])) * len(modes) * len(samplings)
                for s in scenarios.values() for c in args.concurrency)
    total += 0 if hf is None else sum(args.rounds * len(s["prompts"]) * len(HF_MODES) for s in scenarios.values())
    results: dict[str, Any] = {"machine": machine_info(args.model_repository), "config": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    if hf is not None:
        results["hf"] = hf.describe()
    labels = [label_of(name, sampling) for name in scenarios for sampling in samplings]
    with server_for(args) as (url, metrics_url, server), tqdm(total=total, unit="req", dynamic_ncols=True) as bar:
        for name, scenario in scenarios.items():
            task, max_tokens = scenario["task"], scenario["max_tokens"]
            for sampling, concurrency in ((s, c) for s in samplings for c in args.concurrency):
                label = label_of(name, sampling)
                n = requests_per_cell(concurrency, len(scenario["prompts"]))
                prompts = [scenario["prompts"][i % len(scenario["prompts"])] for i in range(n)]
                for round_ in range(args.rounds):
                    order = modes if round_ % 2 == 0 else modes[::-1]
                    for mode in order:
                        bar.set_description(f"{label} c={concurrency} {mode}")
                        params = {"max_tokens": max_tokens, "stream": True, "task": task, **SAMPLINGS[sampling],
                                  "num_draft_tokens": 0 if mode == PLAIN else args.num_draft_tokens.get(name)}
                        if mode.startswith(DRAFTER_MODE_PREFIX):
                            params["drafter"] = mode[len(DRAFTER_MODE_PREFIX):]
                        before = scrape(metrics_url)
                        batch, wall = run_server_batch(url, prompts, params, concurrency, lambda: bar.update(1),
                                                       seeded=sampling != GREEDY)
                        time.sleep(0.2)  # metrics are recorded just after the last response
                        delta = scrape(metrics_url) - before
                        cell = cells.setdefault((label, mode, concurrency), Cell(label, mode, concurrency))
                        cell.wall_s += wall
                        for key, value in server_deltas(delta, task).items():
                            cell.server[key] = cell.server.get(key, 0.0) + value
                        for index, result, error, latency in batch:
                            cell.records.append(Record(
                                label, mode, concurrency, round_, index, latency,
                                result.time_to_first_token_s if result else None,
                                result.num_output_tokens if result else 0,
                                int(result.stats.get("total_draft_tokens", 0)) if result else 0,
                                int(result.stats.get("total_accepted_draft_tokens", 0)) if result else 0,
                                result.text if result else "", error,
                                bool(result.stats.get("fallback_active", 0)) if result else False))
                    if hf is not None and concurrency == 1 and sampling == GREEDY:
                        for mode in HF_MODES:
                            bar.set_description(f"{name} HF {mode}")
                            cell = cells.setdefault((name, mode, 1), Cell(name, mode, 1))
                            for index, prompt in enumerate(prompts):
                                latency, count, text = hf.generate(prompt, max_tokens, mode)
                                cell.wall_s += latency
                                cell.records.append(Record(name, mode, 1, round_, index, latency, None, count,
                                                           text=text))
                                bar.update(1)
        memory = server_memory(scrape(metrics_url), server)
    summaries = []
    for cell in cells.values():
        summary = cell.summary()
        if cell.server.get("target_calls"):
            summary["draft_calls_per_target_call"] = cell.server["draft_calls"] / cell.server["target_calls"]
        summaries.append(summary)
    results["cells"] = summaries
    not_looping = {(label, mode): not_looping_speedup(cells, label, mode)
                   for label, mode, concurrency in cells if concurrency == 1 and is_speculative(mode)}
    results["derived"] = derived(summaries, labels, not_looping)
    results["memory"] = memory
    results["fidelity"] = fidelity(cells)
    results["fidelity_mismatches"] = fidelity_mismatches(cells)
    results["records"] = [asdict(r) | {"text": None} for c in cells.values() for r in c.records]
    results["machine"]["load_average_end"] = os.getloadavg()
    return results


def fidelity(cells: dict[tuple[str, str, int], Cell]) -> dict[str, dict[str, int]]:
    """Greedy outputs of every mode against our plain decoding of the same request at the same concurrency.

    Keyed by mode at concurrency 1 (where the HF peers run too) and ``"<mode> at concurrency <c>"`` above it:
    a batched speculative request must equal the plain one as much as a single one must.
    """
    plain = plain_texts(cells)
    out: dict[str, dict[str, int]] = {}
    for (_, mode, concurrency), cell in sorted(cells.items(), key=lambda item: item[0][2]):
        if mode == PLAIN:
            continue
        entry = out.setdefault(mode if concurrency == 1 else f"{mode} at concurrency {concurrency}",
                               {"equal": 0, "compared": 0})
        for r in cell.records:
            reference = plain.get((r.scenario, concurrency, r.prompt))
            if reference is not None and r.error is None:
                entry["compared"] += 1
                entry["equal"] += int(r.text.strip() == reference)
    return out


def plain_texts(cells: dict[tuple[str, str, int], Cell]) -> dict[tuple[str, int, int], str]:
    """(scenario, concurrency, prompt) -> our plain decoding's output, stripped: what greedy modes must equal."""
    return {(r.scenario, c, r.prompt): r.text.strip() for (label, m, c), cell in cells.items()
            if m == PLAIN and is_greedy(label) for r in cell.records if r.error is None}


MISMATCH_CONTEXT_CHARS = 60  # excerpt on each side of where a greedy output first leaves plain decoding's


def fidelity_mismatches(cells: dict[tuple[str, str, int], Cell]) -> list[dict[str, Any]]:
    """Where each greedy output that differs from plain decoding's (``fidelity``) first leaves it, with both
    texts around that point: enough to tell a logic error from a floating-point tie without the full texts,
    which the results leave out."""
    plain = plain_texts(cells)
    found = []
    for (_, mode, concurrency), cell in cells.items():
        if mode == PLAIN:
            continue
        for r in cell.records:
            reference = plain.get((r.scenario, concurrency, r.prompt))
            got = r.text.strip() if r.error is None else None
            if reference is None or got is None or got == reference:
                continue
            at = next((i for i, (a, b) in enumerate(zip(reference, got, strict=False)) if a != b),
                      min(len(reference), len(got)))
            start = max(0, at - MISMATCH_CONTEXT_CHARS)
            found.append({"scenario": r.scenario, "mode": mode, "concurrency": concurrency, "prompt": r.prompt,
                          "first_difference_char": at, "plain": reference[start:at + MISMATCH_CONTEXT_CHARS],
                          "speculative": got[start:at + MISMATCH_CONTEXT_CHARS]})
    return found


def parse_k(text: str) -> dict[str, int]:
    """`6` (every scenario) or `json=8,code=6,prose=8`."""
    if "=" not in text:
        return dict.fromkeys(("json", "code", "prose"), int(text))
    return {name: int(k) for name, k in (item.split("=", 1) for item in text.split(","))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port of a running server")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics")
    parser.add_argument("--start-server", action="store_true", help="start a server on free ports for the run")
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository",
                        help="served by --start-server; the HF peer loads its checkpoints")
    parser.add_argument("--prompts", type=Path, default=PROMPTS_FILE)
    parser.add_argument("--scenarios", type=lambda s: s.split(","), default=["json", "code", "prose"])
    parser.add_argument("--prompts-per-scenario", type=int, default=8)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                        default=list(DEFAULT_CONCURRENCY))
    parser.add_argument("--rounds", type=int, default=2, help="alternating plain/speculative rounds (ABBA)")
    parser.add_argument("--sampling", type=lambda s: s.split(","), default=[GREEDY],
                        help=f"comma list of {', '.join(SAMPLINGS)} (sampled: a seed per request)")
    parser.add_argument("--num-draft-tokens", type=parse_k, default={},
                        help="speculative requests' k: N for every scenario or json=8,code=6,prose=8 (default: the "
                             "server's profile for the task; an explicit k also overrides the profile's fallback)")
    parser.add_argument("--drafters", type=lambda s: [d for d in s.split(",") if d], default=[],
                        help="e.g. model,eagle: one speculative mode per drafter, interleaved with plain decoding "
                             "(default: one mode, each profile's drafter)")
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face peer")
    parser.add_argument("--hf-fixed-k", type=int, default=6)
    parser.add_argument("--hf-threads", type=int, default=1, help="torch threads of the HF peer (server: 1/model)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "latest")
    args = parser.parse_args(argv)
    if unknown := [s for s in args.sampling if s not in SAMPLINGS]:
        parser.error(f"--sampling: {', '.join(unknown)} not among {', '.join(SAMPLINGS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(args)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    report = markdown(results)
    (args.out / "results.md").write_text(report)
    written = plots(results, args.out)
    print(report)
    print("wrote " + ", ".join(str(p) for p in [args.out / "results.json", args.out / "results.md", *written]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
