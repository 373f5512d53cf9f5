"""Speculation under sampling without a server: the EAGLE head of each repository drafting chains for the
target, in this process (the served runtimes: onnxruntime with each model's threads and weights from its
config.pbtxt), over the held-out chat requests, per decoding mode and domain. Sampled requests are verified
by rejection sampling (lossless), each with its own seed; prints tokens per target call, accepted / drafted
tokens and tokens/s. Heads are run one after the other per cell, so a comparison shares the machine's state.

    python build/measure_sampled.py --repositories model_repository,/tmp/other --prompts 4 --k 3 \\
        --max-tokens 128 --modes t0.7,t1.0,greedy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from measure_proposals import MAX_LENGTH, PROMPTS, served_runtime
from specdec.config import SpeculationSettings
from specdec.engines import DraftEngine, TargetEngine
from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator
from specdec.inprocess import InProcessBackend
from specdec.sampling import SamplingParams
from specdec.tokenizer import TextTokenizer
from specdec_client.bench_prompts import SAMPLINGS

ROOT = Path(__file__).resolve().parents[1]


def run(target: TargetEngine, head: DraftEngine, prompt: list[int], max_tokens: int, task: str, mode: str,
        seed: int, k: int, stats: GenerationStats) -> None:
    sampled = mode != "greedy"
    sampling = SamplingParams(**{**SAMPLINGS[mode], "seed": seed}) if sampled else SamplingParams()
    settings = SpeculationSettings(task, "eagle", k, k, 1, "rejection" if sampled else "greedy", 0.7,
                                   explicit_length=True)
    generator = SpeculativeGenerator(InProcessBackend(target, None, head), MAX_LENGTH)

    async def consume() -> None:
        async for _ in generator.generate(GenerationRequest(prompt, max_tokens, sampling=sampling,
                                                            settings=settings), 1, stats):
            pass

    asyncio.run(consume())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repositories", default=str(ROOT / "model_repository"),
                    help="comma-separated model repositories whose eagle_draft heads are compared")
    ap.add_argument("--prompts", type=int, default=4, help="held-out chat requests per domain")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per chain")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--modes", default="t0.7,t1.0,greedy", help=f"comma-separated, of {sorted(SAMPLINGS)}")
    args = ap.parse_args(argv)
    repositories = [Path(r) for r in args.repositories.split(",")]
    modes = args.modes.split(",")
    if unknown := [m for m in modes if m not in SAMPLINGS]:
        ap.error(f"--modes: unknown {unknown}")
    target = TargetEngine(served_runtime(ROOT / "model_repository/target_model/1"), 60)
    heads = {r: DraftEngine(served_runtime(r / "eagle_draft/1"), 60) for r in repositories}
    tokenizer = TextTokenizer(ROOT / "model_repository/target_model/1")
    scenarios = json.loads(PROMPTS.read_text(encoding="utf-8"))["scenarios"]
    report: dict = {}
    for mode in modes:
        for domain, scenario in scenarios.items():
            prompts = [tokenizer.encode(p["prompt"]) for p in scenario["prompts"][:args.prompts]]
            for repository, head in heads.items():
                stats = GenerationStats()
                started = time.perf_counter()
                for i, prompt in enumerate(prompts):
                    run(target, head, prompt, args.max_tokens, scenario["task"], mode, 1000 + i, args.k, stats)
                row = {"tokens_per_call": stats.output_tokens / max(stats.verification_passes, 1),
                       "accepted": stats.accepted_draft_tokens, "drafted": stats.draft_tokens,
                       "tokens_per_s": stats.output_tokens / (time.perf_counter() - started)}
                report.setdefault(mode, {}).setdefault(domain, {})[str(repository)] = row
                print(f"{mode:6s} {domain:6s} {repository.name:18s} tokens/call {row['tokens_per_call']:.3f} "
                      f"accepted/drafted {row['accepted']}/{row['drafted']} = "
                      f"{row['accepted'] / max(row['drafted'], 1):.3f} tok/s {row['tokens_per_s']:.1f}", flush=True)
    return report


if __name__ == "__main__":
    main()
