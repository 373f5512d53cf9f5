"""What the OpenAI-compatible endpoint adds: the same streamed greedy requests sent directly over gRPC
(tritonclient's aio client, as the endpoint itself calls Triton) and through the endpoint (the official openai
client), interleaved round by round, at each concurrency. Prints medians; not a test.

    python -m specdec_client.bench_openai --start-server --concurrency 1,16 --rounds 3
    python -m specdec_client.bench_openai --grpc-url 127.0.0.1:8001 --openai-url http://127.0.0.1:9000/v1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import openai

from specdec_client.openai_api.triton import TritonBackend
from specdec_client.server import OpenAIEndpoint, TritonServer, free_port

PROMPTS = Path(__file__).resolve().parent / "prompts" / "smoke.json"
MODEL = "ensemble"


@dataclass
class Sample:
    latency_s: float
    first_s: float
    chunks: int  # responses carrying text
    text: str


async def via_grpc(backend: TritonBackend, prompt: str, max_tokens: int) -> Sample:
    started = time.perf_counter()
    first, chunks, text = None, 0, []
    async for chunk in backend.stream(prompt, max_tokens, {"temperature": 0.0}):
        if chunk.text:
            first = first or time.perf_counter() - started
            chunks += 1
            text.append(chunk.text)
    return Sample(time.perf_counter() - started, first or 0.0, chunks, "".join(text))


async def via_openai(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> Sample:
    started = time.perf_counter()
    first, chunks, text = None, 0, []
    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True)
    async for event in stream:
        piece = event.choices[0].text if event.choices else ""
        if piece:
            first = first or time.perf_counter() - started
            chunks += 1
            text.append(piece)
    return Sample(time.perf_counter() - started, first or 0.0, chunks, "".join(text))


async def measure(grpc_url: str, openai_url: str, concurrency: list[int], rounds: int, max_tokens: int,
                  prompts: list[str]) -> dict[int, dict[str, list[Sample]]]:
    backend = TritonBackend(grpc_url)
    client = openai.AsyncOpenAI(base_url=openai_url, api_key="unused", max_retries=0, timeout=600)
    results: dict[int, dict[str, list[Sample]]] = {}
    try:
        await via_grpc(backend, prompts[0], 4)  # warm both paths
        await via_openai(client, prompts[0], 4)
        for c in concurrency:
            batch = [prompts[i % len(prompts)] for i in range(c)]
            got: dict[str, list[Sample]] = {"grpc": [], "openai": []}
            for r in range(rounds):  # interleaved, the order alternating per round
                order = ("grpc", "openai") if r % 2 == 0 else ("openai", "grpc")
                for path in order:
                    call = (lambda p: via_grpc(backend, p, max_tokens)) if path == "grpc" else \
                        (lambda p: via_openai(client, p, max_tokens))
                    got[path] += await asyncio.gather(*(call(p) for p in batch))
            mismatched = sum(a.text != b.text for a, b in zip(got["grpc"], got["openai"], strict=True))
            if mismatched:
                print(f"warning: {mismatched} texts differ between the two paths at concurrency {c}", file=sys.stderr)
            results[c] = got
    finally:
        await backend.close()
        await client.close()
    return results


def report(results: dict[int, dict[str, list[Sample]]], max_tokens: int) -> str:
    lines = [f"streamed greedy completions, max_tokens {max_tokens}; medians over the requests of each path",
             "concurrency | requests | chunks/req | latency gRPC / OpenAI (ms) | added per request (ms) | "
             "first text gRPC / OpenAI (ms) | added per chunk (ms)"]
    for c, got in results.items():
        grpc, oai = got["grpc"], got["openai"]
        lat_g, lat_o = (statistics.median(s.latency_s for s in x) * 1e3 for x in (grpc, oai))
        ttft_g, ttft_o = (statistics.median(s.first_s for s in x) * 1e3 for x in (grpc, oai))
        chunks = statistics.median(s.chunks for s in oai)
        lines.append(f"{c:>11} | {len(grpc):>8} | {chunks:>10.0f} | {lat_g:>11.1f} / {lat_o:<11.1f} | "
                     f"{lat_o - lat_g:>22.1f} | {ttft_g:>13.1f} / {ttft_o:<13.1f} | "
                     f"{(lat_o - lat_g) / max(chunks, 1):>19.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpc-url", default="127.0.0.1:8001")
    parser.add_argument("--openai-url", default="http://127.0.0.1:9000/v1")
    parser.add_argument("--start-server", action="store_true", help="start tritonserver and the endpoint here")
    parser.add_argument("--model-repository", type=Path, default=None)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="also write the samples here")
    args = parser.parse_args(argv)
    prompts = [p for group in json.loads(PROMPTS.read_text()).values() for p in group]
    concurrency = [int(c) for c in args.concurrency.split(",")]

    def run(grpc_url: str, openai_url: str) -> dict:
        return asyncio.run(measure(grpc_url, openai_url, concurrency, args.rounds, args.max_tokens, prompts))

    if args.start_server:
        extra = {"model_repository": args.model_repository.resolve()} if args.model_repository else {}
        log_dir = Path(tempfile.mkdtemp(prefix="bench-openai-"))
        with TritonServer(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                          log_file=log_dir / "server.log", **extra) as server:
            tokenizer = (server.model_repository / "target_model" / "1").resolve()
            with OpenAIEndpoint(server.grpc_url, free_port(), extra_args=["--tokenizer", str(tokenizer)],
                                log_file=log_dir / "openai.log") as endpoint:
                results = run(server.grpc_url, endpoint.base_url)
    else:
        results = run(args.grpc_url, args.openai_url)
    print(report(results, args.max_tokens))
    if args.json:
        args.json.write_text(json.dumps({c: {k: [s.__dict__ for s in v] for k, v in got.items()}
                                         for c, got in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
