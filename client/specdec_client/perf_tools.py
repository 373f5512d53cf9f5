"""Run NVIDIA's perf_analyzer and genai-perf against the served `ensemble` (make perf-analyzer / genai-perf).

perf_analyzer 2.51 comes with the `tritonclient[all]==2.51.0` wheel (`.venv/bin/perf_analyzer`, it needs the
venv's `nvidia/cuda_runtime/lib` on LD_LIBRARY_PATH); genai-perf 0.0.16 lives in its own venv
(`.venv-genai-perf`, `make genai-perf-env`) because its dependencies would move the server venv's pins.
Inputs are the held-out prompts of `client/perf/` (made by `python -m specdec_client.bench_prompts`).

    perf-tools perf-analyzer --scenario json --concurrency 1,4 [--start-server]
    perf-tools genai-perf --scenario code --concurrency 4 [--start-server]
    perf-tools genai-perf-openai --scenario code --concurrency 4 [--start-server | --openai-url HOST:PORT]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from specdec_client.bench_prompts import PERF_DIR, SCENARIOS
from specdec_client.server import REPO_ROOT, OpenAIEndpoint, TritonServer, free_port

MODEL = "ensemble"
GENAI_PERF_VENV = Path(os.environ.get("GENAI_PERF_VENV", REPO_ROOT / ".venv-genai-perf"))
TOKENIZER_DIR = REPO_ROOT / "model_repository" / "target_model" / "1"


def perf_analyzer_binary() -> Path:
    return Path(sys.executable).parent / "perf_analyzer"


def tool_environment() -> dict[str, str]:
    """perf_analyzer links libcudart (loaded even on CPU-only servers): the wheel's copy goes first; genai-perf
    runs the perf_analyzer it finds on PATH (its own wheel ships a placeholder): this venv's 2.51 one."""
    cuda_lib = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cuda_runtime" / "lib"
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(perf_analyzer_binary().parent), env.get("PATH", "")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join([str(cuda_lib), *filter(None, [env.get("LD_LIBRARY_PATH")])])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def perf_analyzer_command(grpc_url: str, input_data: Path, concurrency: str = "1", request_count: int | None = None,
                          export: Path | None = None, measurement_ms: int = 20000) -> list[str]:
    """perf_analyzer over gRPC streaming (the ensemble is decoupled) with our input data file."""
    command = [str(perf_analyzer_binary()), "-m", MODEL, "-u", grpc_url, "-i", "grpc", "--streaming",
               "--input-data", str(input_data), "--concurrency-range", concurrency, "--percentile", "99",
               "--stability-percentage", "50", "--max-trials", "5"]
    if request_count:
        command += ["--request-count", str(request_count)]
    else:
        command += ["--measurement-interval", str(measurement_ms)]
    if export is not None:
        command += ["--profile-export-file", str(export)]
    return command


def genai_perf_command(grpc_url: str, scenario: str, concurrency: int, request_count: int,
                       artifacts: Path) -> list[str]:
    """genai-perf profile with the TensorRT-LLM ensemble contract, a local tokenizer and our prompts."""
    _, _, max_tokens = SCENARIOS[scenario]
    prompts = PERF_DIR / f"genai_perf_{scenario}.jsonl"
    return [str(GENAI_PERF_VENV / "bin" / "genai-perf"), "profile", "-m", MODEL,
            "--endpoint-type", "kserve", "--backend", "tensorrtllm", "--streaming", "-u", grpc_url,
            "--tokenizer", str(TOKENIZER_DIR), "--input-file", str(prompts),
            "--num-prompts", str(sum(1 for _ in prompts.open())),
            "--output-tokens-mean", str(max_tokens), "--output-tokens-mean-deterministic",
            "--concurrency", str(concurrency), "--request-count", str(request_count),
            "--warmup-request-count", "0", "--artifact-dir", str(artifacts)]


def genai_perf_openai_command(openai_url: str, scenario: str, concurrency: int, request_count: int,
                              artifacts: Path) -> list[str]:
    """genai-perf profile against the OpenAI-compatible endpoint (its `completions` endpoint type)."""
    _, _, max_tokens = SCENARIOS[scenario]
    prompts = PERF_DIR / f"genai_perf_{scenario}.jsonl"
    return [str(GENAI_PERF_VENV / "bin" / "genai-perf"), "profile", "-m", MODEL,
            "--endpoint-type", "completions", "--streaming", "-u", openai_url,
            "--tokenizer", str(TOKENIZER_DIR), "--input-file", str(prompts),
            "--num-prompts", str(sum(1 for _ in prompts.open())),
            "--output-tokens-mean", str(max_tokens), "--extra-inputs", f"min_tokens:{max_tokens}",
            "--concurrency", str(concurrency), "--request-count", str(request_count),
            "--warmup-request-count", "0", "--artifact-dir", str(artifacts)]


@contextlib.contextmanager
def maybe_openai(start: bool, grpc_url: str, openai_url: str, log: Path) -> Iterator[str]:
    """Yield host:port of an OpenAI-compatible endpoint: the given one, or one started in front of grpc_url."""
    if not start:
        yield openai_url
        return
    with OpenAIEndpoint(grpc_url, free_port(), extra_args=["--tokenizer", str(TOKENIZER_DIR)], log_file=log) as ep:
        yield f"{ep.host}:{ep.port}"


@contextlib.contextmanager
def maybe_server(start: bool, grpc_url: str, log: Path) -> Iterator[str]:
    """Yield the gRPC url of a running server: the given one, or a fresh one on free ports."""
    if not start:
        yield grpc_url
        return
    server = TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), log_file=log)
    with server:
        yield server.grpc_url


def run(command: list[str], cwd: Path | None = None) -> int:
    print("$ " + shlex.join(command), flush=True)
    return subprocess.run(command, env=tool_environment(), cwd=cwd, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tool", choices=("perf-analyzer", "genai-perf", "genai-perf-openai"))
    parser.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port of a running server")
    parser.add_argument("--openai-url", default="127.0.0.1:9000",
                        help="genai-perf-openai: host:port of a running OpenAI-compatible endpoint")
    parser.add_argument("--start-server", action="store_true", help="start a server on free ports for the run")
    parser.add_argument("--scenario", choices=tuple(SCENARIOS), action="append")
    parser.add_argument("--concurrency", default="1", help="perf_analyzer range start:end:step, genai-perf: N")
    parser.add_argument("--request-count", type=int, default=32)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "perf")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    status = 0
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(maybe_server(args.start_server, args.url, args.out / "server.log"))
        if args.tool == "genai-perf-openai":
            openai_url = stack.enter_context(maybe_openai(args.start_server, url, args.openai_url,
                                                          args.out / "openai.log"))
        for scenario in args.scenario or list(SCENARIOS):
            if args.tool == "perf-analyzer":
                command = perf_analyzer_command(url, PERF_DIR / f"{scenario}.json", args.concurrency,
                                                args.request_count, args.out / f"perf_analyzer_{scenario}.json")
            else:
                if not (GENAI_PERF_VENV / "bin" / "genai-perf").exists():
                    print("genai-perf is not installed: run `make genai-perf-env`", file=sys.stderr)
                    return 2
                to_openai = args.tool == "genai-perf-openai"
                make = genai_perf_openai_command if to_openai else genai_perf_command
                artifacts = args.out / f"{args.tool.replace('-', '_')}_{scenario}"
                command = make(openai_url if to_openai else url, scenario, int(args.concurrency),
                               args.request_count, artifacts)
            status = run(command) or status
    return status


if __name__ == "__main__":
    sys.exit(main())
