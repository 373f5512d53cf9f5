"""Long-context figures of the paged KV cache and chunked prefill (docs/KV_MEMORY.md), printed, not asserted.

1. KV memory of SmolLM2-135M's shape (plus a 1-layer draft of the same width) at 2 x 8,192 and 64 x 256
   tokens, read from the runtime's own accounting (blocks held x bytes per block of the allocated pool),
   against what the old static cache preallocated for the same slots at the full 8,192 context.
2. Time to first token of a 4,096-token prompt (in-process engines, no server).
3. Inter-token latency of a running stream while another request prefills 6,000 tokens, with and without
   chunked prefill (BatchingBackend batches concurrent steps as Triton's sequence batcher does).

    python build/measure_long_context.py --model data/smollm2_hf [--runtime torch] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import numpy as np
from specdec.engines import TargetEngine
from specdec.generation import GenerationRequest, SpeculativeGenerator
from specdec.inprocess import BatchingBackend
from specdec.kv_memory import DEFAULT_BLOCK_SIZE, PoolModel, blocks_for, pair_pool_blocks
from specdec.runtime import build_runtime

CONTEXT = 8192
BUDGET = 805_306_368  # build/deployments/cpu.yaml kv_cache.budget_bytes


def kv_memory(model: Path, runtime_kind: str) -> None:
    runtime = build_runtime(runtime_kind, model, num_slots=64, max_length=CONTEXT, num_threads=1,
                            num_blocks=pair_pool_blocks(BUDGET, DEFAULT_BLOCK_SIZE, _pair(runtime_kind, model)),
                            block_size=DEFAULT_BLOCK_SIZE)
    per_token = runtime.kv_bytes_per_block / DEFAULT_BLOCK_SIZE
    draft = PoolModel(1, runtime.spec.num_kv_heads, runtime.spec.head_dim, 4)
    print(f"target pool: {runtime.kv.num_blocks} blocks x {DEFAULT_BLOCK_SIZE} tokens, "
          f"{runtime.kv_cache_bytes / 2**20:.1f} MiB allocated ({per_token:.0f} B/token); "
          f"a 1-layer draft of the same width: {draft.bytes_per_token} B/token")
    for sequences, tokens in ((2, 8192), (64, 256)):
        for slot in range(sequences):
            runtime.resize_rows(slot, tokens)
        held = runtime.kv_bytes_in_use
        draft_held = runtime.kv.blocks_in_use * DEFAULT_BLOCK_SIZE * draft.bytes_per_token
        static = sequences * CONTEXT * (per_token + draft.bytes_per_token)
        print(f"{sequences} x {tokens} tokens: target {held / 2**20:.1f} MiB + draft {draft_held / 2**20:.1f} MiB "
              f"= {(held + draft_held) / 2**20:.1f} MiB held (budget {BUDGET / 2**20:.0f} MiB); the static cache "
              f"at {CONTEXT} rows per slot: {static / 2**30:.2f} GiB")
        for slot in range(sequences):
            runtime.release(slot)
    assert runtime.kv.blocks_in_use == 0


def _pair(runtime_kind: str, model: Path) -> list[PoolModel]:
    from specdec.checkpoint import read_spec

    spec = read_spec(model)
    return [PoolModel(spec.num_layers, spec.num_kv_heads, spec.head_dim, 4),
            PoolModel(1, spec.num_kv_heads, spec.head_dim, 4)]


def engine(model: Path, runtime_kind: str, threads: int) -> TargetEngine:
    runtime = build_runtime(runtime_kind, model, num_slots=4, max_length=CONTEXT, num_threads=threads,
                            num_blocks=4 * blocks_for(CONTEXT, DEFAULT_BLOCK_SIZE))
    return TargetEngine(runtime, idle_timeout_s=600)


def prompt_of(length: int, vocab: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(100, vocab, length)]


def time_to_first_token(target: TargetEngine, length: int, chunk: int) -> float:
    generator = SpeculativeGenerator(BatchingBackend(target), CONTEXT, prefill_chunk=chunk)

    async def run() -> float:
        began = time.perf_counter()
        async for _update in generator.generate(GenerationRequest(prompt_of(length, target.runtime.vocab_size, 1), 1),
                                                1):
            return time.perf_counter() - began
        raise RuntimeError("no token")

    return asyncio.run(run())


def latency_under_prefill(target: TargetEngine, length: int, chunk: int) -> dict[str, float]:
    """A stream decodes; after its 5th token a `length`-token prompt arrives. Gaps between the stream's
    tokens while that prompt is prefilled (until its first token)."""
    generator = SpeculativeGenerator(BatchingBackend(target), CONTEXT, prefill_chunk=chunk)
    vocab = target.runtime.vocab_size

    async def run() -> dict[str, float]:
        stamps: list[float] = []
        window: list[float] = []
        long_done = asyncio.Event()
        fifth = asyncio.Event()

        async def stream() -> None:
            async for update in generator.generate(GenerationRequest(prompt_of(32, vocab, 2), 4000), 1,
                                                   is_cancelled=long_done.is_set):
                if update.token_ids:
                    stamps.append(time.perf_counter())
                if len(stamps) == 5:
                    fifth.set()

        async def long_prompt() -> None:
            await fifth.wait()
            window.append(time.perf_counter())
            async for _update in generator.generate(GenerationRequest(prompt_of(length, vocab, 3), 1), 2):
                window.append(time.perf_counter())
                break
            long_done.set()

        await asyncio.gather(stream(), long_prompt())
        before = np.diff(stamps[:5]) * 1000
        gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b > window[0] and a < window[1]]
        gaps_ms = [g * 1000 for g in gaps] or [float("nan")]
        return {"itl_before_ms": float(np.median(before)), "median_ms": statistics.median(gaps_ms),
                "max_ms": max(gaps_ms), "tokens_during": len(gaps), "prefill_s": window[1] - window[0]}

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("data/smollm2_hf"))
    parser.add_argument("--runtime", default="torch", choices=("torch", "onnxruntime"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--skip", nargs="*", default=[], choices=("memory", "ttft", "itl"))
    args = parser.parse_args(argv)
    if "memory" not in args.skip:
        kv_memory(args.model, args.runtime)
    target = engine(args.model, args.runtime, args.threads)
    if "ttft" not in args.skip:
        for chunk in (args.chunk, 0):
            print(f"time to first token, 4096-token prompt, prefill chunk {chunk or 'off'}: "
                  f"{time_to_first_token(target, 4096, chunk):.2f} s")
    if "itl" not in args.skip:
        for chunk in (args.chunk, 0):
            r = latency_under_prefill(target, 6000, chunk)
            print(f"running stream while a 6000-token prompt prefills, chunk {chunk or 'off'}: ITL before "
                  f"{r['itl_before_ms']:.0f} ms; during: median {r['median_ms']:.0f} ms, max {r['max_ms']:.0f} ms, "
                  f"{r['tokens_during']} tokens; the long prompt's first token after {r['prefill_s']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
