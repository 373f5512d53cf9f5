"""The checks that need an NVIDIA GPU, one step per subcommand; build/gpu_check.sh runs them all in order.

    env         versions, GPU, what is installed
    torch-cuda  the committed pair on the torch runtime on CUDA: logits vs the CPU runtime, greedy
                speculation == plain greedy over 64 tokens, per-step costs and c (draft / target), and
                whether a verification pass gives the same logits as decode steps (bit for bit)
    tensorrt    engines of the committed pair (fp32 and fp16) with build/build_engines.py; parity with torch
                on CUDA (max |logit diff|, argmax agreement, 64 greedy tokens); per-step costs and c,
                interleaved with the torch runtime
    server      tritonserver end to end with a rendered deployment (torch on KIND_GPU by default; tensorrt
                with --engine-dir): greedy /generate with and without speculation must agree
    render      not a check: write <out>/model_repository, the GPU deployment to bench (docs/BENCHMARKS.md)

Every step prints its figures and merges them into <out>/gpu_check.json. The `server` step also runs on a
CPU (`--kind KIND_CPU --runtime onnxruntime|torch`), which is how it was verified without a GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "build"))

TARGET = REPO_ROOT / "model_repository" / "target_model" / "1"
DRAFT = REPO_ROOT / "model_repository" / "draft_model" / "1"
PROMPTS = json.loads((REPO_ROOT / "client" / "specdec_client" / "prompts" / "smoke.json").read_text())
GPU_YAML = REPO_ROOT / "build" / "deployments" / "gpu.yaml"
CHECK_SLOTS, CHECK_LENGTH = 8, 512  # small engines build fast; enough for the prompts and 64 tokens
SERVER_MAX_TOKENS = 128
BENCH_SLOTS, BENCH_LENGTH = 32, 2048  # `render`: room for 16 concurrent chat requests and their drafts
# The server step's requests per prompt, each compared with plain greedy: the draft model and the EAGLE head
# at a fixed k, and the task's profile (its drafter and k, docs/SPECULATION.md).
SERVER_MODES: dict[str, dict[str, Any]] = {
    "plain": {"num_draft_tokens": 0},
    "model_k6": {"drafter": "model", "num_draft_tokens": 6},
    "eagle_k6": {"drafter": "eagle", "num_draft_tokens": 6},
    "profile": {},
}


def record(out: Path, step: str, figures: dict[str, Any]) -> None:
    path = out / "gpu_check.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[step] = figures
    path.write_text(json.dumps(data, indent=2, default=str))
    print(f"[gpu_check] {step}: " + json.dumps(figures, default=str), flush=True)


def prompt_ids() -> list[list[int]]:
    from specdec.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(TARGET)
    return [tokenizer.encode(PROMPTS[task][0]) for task in ("json", "code", "text") if task in PROMPTS]


def compare(reference, runtime, prompts: list[list[int]]) -> dict[str, float]:
    """Max |logit diff| and argmax agreement over every prompt position (one batched prefill) and a tree step."""
    from specdec.runtime.base import ForwardItem
    from specdec.runtime.parity import logit_parity

    items = [ForwardItem(i, 0, np.asarray(p), num_logits=len(p)) for i, p in enumerate(prompts)]
    tree = [ForwardItem(0, len(prompts[0]), np.array([11, 12, 13, 14]), num_logits=4,
                        tree_parents=np.array([-1, 0, 0, 1]))]
    a = np.concatenate(reference.forward(items) + reference.forward(tree))
    b = np.concatenate(runtime.forward(items) + runtime.forward(tree))
    max_diff, agreement = logit_parity(a, b)
    return {"max_abs_logit_diff": max_diff, "argmax_agreement": agreement, "positions": int(len(a))}


def decode_vs_verify(runtime, prompt: list[int], k: int = 6) -> dict[str, float]:
    """The same k+1 positions' logits from one verification pass and from k+1 one-token decode steps.

    Greedy speculation equals plain greedy decoding exactly only where the two agree bit for bit; kernels
    chosen by the number of rows (onnxruntime's single-row products, cuBLAS, attention) break that, so a
    top-2 tie can flip (docs/SPECULATION.md, "Bit-identical greedy output").
    """
    from specdec.runtime.base import ForwardItem

    past = len(prompt) - (k + 1)
    ids = np.asarray(prompt)
    runtime.forward([ForwardItem(0, 0, ids[:past])])
    verify = runtime.forward([ForwardItem(0, past, ids[past:], num_logits=k + 1)])[0]
    decode = np.concatenate([runtime.forward([ForwardItem(0, past + j, ids[past + j:past + j + 1])])[0]
                             for j in range(k + 1)])
    diff = np.abs(verify.astype(np.float64) - decode)
    return {"max_abs_logit_diff": float(diff.max()), "bitwise_equal_rows": int((diff.max(axis=1) == 0).sum()),
            "rows": k + 1, "argmax_agreement": float((verify.argmax(1) == decode.argmax(1)).mean())}


def generate(target, draft, prompt: list[int], k: int, max_tokens: int = 64) -> list[int]:
    from specdec.engines import DraftEngine, TargetEngine
    from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator
    from specdec.inprocess import InProcessBackend

    generator = SpeculativeGenerator(InProcessBackend(TargetEngine(target, 60), DraftEngine(draft, 60)),
                                     target.max_length)

    async def collect() -> list[int]:
        out: list[int] = []
        async for update in generator.generate(GenerationRequest(prompt, max_tokens, num_draft_tokens=k),
                                               int(time.time_ns() % 2**62), GenerationStats()):
            out.extend(update.token_ids)
        return out

    return asyncio.run(collect())


def step_env(args: argparse.Namespace) -> None:
    figures: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine()}
    try:
        import torch

        figures["torch"] = torch.__version__
        figures["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            figures["gpu"] = torch.cuda.get_device_name()
            figures["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    except ImportError:
        figures["torch"] = None
    import importlib.util

    figures["tritonserver_wheel"] = importlib.util.find_spec("pytriton") is not None  # not imported: no deps
    for module in ("tensorrt", "onnx", "onnxruntime", "tritonclient"):
        try:
            imported = __import__(module)
            figures[module] = getattr(imported, "__version__", "present")
        except Exception as exc:  # absent, or present but unloadable (no libnvinfer)
            figures[module] = f"unavailable: {type(exc).__name__}"
    record(args.out, "env", figures)


def step_torch_cuda(args: argparse.Namespace) -> None:
    import measure_runtimes
    from specdec.runtime.torch_llama import TorchLlamaRuntime

    prompts = prompt_ids()
    figures: dict[str, Any] = {}
    device = args.device
    figures: dict[str, Any] = {"device": device}
    for role, folder in (("target", TARGET), ("draft", DRAFT)):
        cpu = TorchLlamaRuntime(folder, num_slots=4, max_length=CHECK_LENGTH, num_threads=4)
        other = TorchLlamaRuntime(folder, num_slots=4, max_length=CHECK_LENGTH, device=device)
        figures[f"{role}_{device}_vs_cpu"] = compare(cpu, other, prompts)
    target = TorchLlamaRuntime(TARGET, num_slots=4, max_length=CHECK_LENGTH, device=device)
    draft = TorchLlamaRuntime(DRAFT, num_slots=4, max_length=CHECK_LENGTH, device=device)
    longest = max(prompts, key=len)
    figures[f"target_{device}_decode_vs_verify"] = decode_vs_verify(target, longest)
    figures["target_cpu_decode_vs_verify"] = decode_vs_verify(
        TorchLlamaRuntime(TARGET, num_slots=4, max_length=CHECK_LENGTH, num_threads=4), longest)
    same = [generate(target, draft, p, 6) == generate(target, draft, p, 0) for p in prompts]
    figures["greedy_speculative_equals_plain_64"] = f"{sum(same)}/{len(same)}"
    measure_runtimes.main(["--runtimes", "torch", "--device", device, "--repeats", "200", "--generate",
                           "--json", str(args.out / "steps_torch_cuda.json")])
    figures["steps"] = json.loads((args.out / "steps_torch_cuda.json").read_text())
    record(args.out, "torch_cuda", figures)


def step_tensorrt(args: argparse.Namespace) -> None:
    import build_engines
    import measure_runtimes
    from specdec.runtime import build_runtime
    from specdec.runtime.torch_llama import TorchLlamaRuntime

    deployment = yaml.safe_load(GPU_YAML.read_text())
    deployment["kv_cache"].update(num_slots=CHECK_SLOTS, max_length=CHECK_LENGTH)
    deployment["models"]["draft_model"]["num_slots"] = CHECK_SLOTS
    figures: dict[str, Any] = {}
    for precision in ("fp32", "fp16"):
        out = args.out / "engines" / precision
        started = time.perf_counter()
        for plan in build_engines.plan_engines(deployment, REPO_ROOT / "model_repository", out, None,
                                               {"precision": precision, "max_prefill_tokens": 256}):
            meta = build_engines.build_one(plan)
            figures[f"{plan.model}_{precision}_build_s"] = meta.build_seconds
            figures[f"{plan.model}_{precision}_plan_mib"] = round(meta.builder["plan_bytes"] / 2**20, 2)
        figures[f"{precision}_total_build_s"] = round(time.perf_counter() - started, 1)
    prompts = prompt_ids()
    for precision in ("fp32", "fp16"):
        engines = args.out / "engines" / precision
        pair = {}
        for role, folder, model in (("target", TARGET, "target_model"), ("draft", DRAFT, "draft_model")):
            reference = TorchLlamaRuntime(folder, num_slots=4, max_length=CHECK_LENGTH, device="cuda")
            engine = build_runtime("tensorrt", folder, num_slots=4, max_length=CHECK_LENGTH, device="cuda",
                                   engine_dir=engines / model)
            figures[f"{role}_{precision}_vs_torch_cuda"] = compare(reference, engine, prompts)
            pair[role] = (TorchLlamaRuntime(folder, num_slots=4, max_length=CHECK_LENGTH, device="cuda"), engine)
        agree = []
        for p in prompts:
            expected = generate(pair["target"][0], pair["draft"][0], p, 6)
            got = generate(pair["target"][1], pair["draft"][1], p, 6)
            agree.append(next((i for i, (x, y) in enumerate(zip(expected, got, strict=True)) if x != y), len(got)))
        figures[f"{precision}_greedy_tokens_identical_of_64"] = agree
    measure_runtimes.main(["--runtimes", "torch,tensorrt", "--device", "cuda", "--engine-dir",
                           str(args.out / "engines" / "fp16"), "--repeats", "200", "--generate",
                           "--json", str(args.out / "steps_tensorrt_fp16.json")])
    figures["steps_fp16"] = json.loads((args.out / "steps_tensorrt_fp16.json").read_text())
    record(args.out, "tensorrt", figures)


def render_repository(deployment: dict, root: Path) -> Path:
    """A copy of model_repository/ (files as symlinks) with configs rendered from `deployment`."""
    import render_configs

    repo = root / "model_repository"
    shutil.copytree(REPO_ROOT / "model_repository", repo, copy_function=os.symlink,
                    ignore=shutil.ignore_patterns("__pycache__", "onnx", "config.pbtxt"))
    source = root / "deployment.yaml"
    source.write_text(yaml.safe_dump(deployment))
    for name, text in render_configs.render_text(source).items():
        (repo / name / "config.pbtxt").write_text(text)
    return repo


DECODERS = ("target_model", "draft_model", "eagle_draft")


def gpu_deployment(runtime: str, num_slots: int, max_length: int) -> dict[str, Any]:
    """gpu.yaml with another runtime, and `num_slots` KV slots of `max_length` per decoder instance."""
    deployment = yaml.safe_load(GPU_YAML.read_text())
    deployment["runtime"] = runtime
    deployment["kv_cache"].update(num_slots=num_slots, max_length=max_length)
    for name in DECODERS:
        if name in deployment["models"]:
            deployment["models"][name]["num_slots"] = num_slots
    return deployment


def step_server(args: argparse.Namespace) -> None:
    from specdec_client.api import generate_http
    from specdec_client.server import TritonServer, free_port

    deployment = gpu_deployment(args.runtime, CHECK_SLOTS, CHECK_LENGTH)
    for name in DECODERS:
        model = deployment["models"].get(name)
        if model is None:
            continue
        model["kind"] = args.kind
        if args.kind == "KIND_CPU":  # a CPU rehearsal: one instance each, no GPU ids
            model.update(instances=1)
            model.pop("gpus", None)
    if args.engine_dir:
        os.environ["SPECDEC_ENGINE_DIR"] = str(args.engine_dir.resolve())
    figures: dict[str, Any] = {"runtime": args.runtime, "kind": args.kind}
    with tempfile.TemporaryDirectory(prefix="specdec-gpu-check-") as tmp:
        repo = render_repository(deployment, Path(tmp))
        server = TritonServer(model_repository=repo, http_port=free_port(), grpc_port=free_port(),
                              metrics_port=free_port(), log_file=args.out / "server.log")
        started = time.perf_counter()
        server.start(timeout_s=300)
        figures["ready_s"] = round(time.perf_counter() - started, 1)
        try:
            rows = []
            for task in ("json", "code", "text"):
                text = PROMPTS[task][0]
                base = {"text_input": text, "max_tokens": SERVER_MAX_TOKENS, "task": task}
                generate_http(server.http_url, {**base, "max_tokens": 8})  # warm-up: first-call costs
                results = {mode: generate_http(server.http_url, {**base, **params})
                           for mode, params in SERVER_MODES.items()}
                plain = results["plain"]
                row: dict[str, Any] = {"task": task, "plain_tok_s": round(plain.tokens_per_second, 1)}
                for mode, result in results.items():
                    if mode != "plain":
                        row[mode] = {"identical": result.text == plain.text,
                                     "tok_s": round(result.tokens_per_second, 1),
                                     "speedup": round(result.tokens_per_second / plain.tokens_per_second, 2),
                                     "acceptance_rate": result.stats.get("acceptance_rate"),
                                     "drafter_used": result.drafter_used}
                rows.append(row)
            figures["requests"] = rows
        finally:
            server.stop()
    record(args.out, "server", figures)


def step_render(args: argparse.Namespace) -> None:
    """A GPU repository to bench (<out>/model_repository): gpu.yaml with --runtime, BENCH_SLOTS KV slots per
    decoder instance and context BENCH_LENGTH; `bench --start-server --model-repository` serves it."""
    deployment = gpu_deployment(args.runtime, BENCH_SLOTS, BENCH_LENGTH)
    if args.engine_dir:
        os.environ["SPECDEC_ENGINE_DIR"] = str(args.engine_dir.resolve())
    print(render_repository(deployment, args.out))


STEPS = {"env": step_env, "torch-cuda": step_torch_cuda, "tensorrt": step_tensorrt, "server": step_server,
         "render": step_render}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=sorted(STEPS))
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "gpu_check")
    parser.add_argument("--runtime", default="torch", help="server: the decoders' runtime")
    parser.add_argument("--kind", default="KIND_GPU", choices=("KIND_GPU", "KIND_CPU"), help="server: placement")
    parser.add_argument("--engine-dir", type=Path, help="server with tensorrt: engines of build_engines.py")
    parser.add_argument("--device", default="cuda", help="torch-cuda: the torch device (cpu to rehearse)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    STEPS[args.step](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
