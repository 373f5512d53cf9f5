"""Per-step cost of the decoder runtimes and c = draft step / target step, measured interleaved in one process.

For every runtime (torch, onnxruntime, ...) it loads the target and the draft of a model pair, prefills a
real prompt to `--context` tokens, then times, round-robin over the runtimes so that machine noise hits all
of them alike: one draft step (1 token), one target step (1 token) and one verification pass (k+1 tokens),
all at the same cache length (rollback by length makes the repeats legitimate). With `--generate` it also
times whole greedy generations (plain and speculative) through SpeculativeGenerator, interleaved too.
Prints medians and writes JSON with `--json`. Usage:

    python build/measure_runtimes.py --runtimes torch,onnxruntime --repeats 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from specdec.engines import DraftEngine, TargetEngine
from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator
from specdec.inprocess import InProcessBackend
from specdec.runtime import build_runtime
from specdec.runtime.base import DecoderRuntime, ForwardItem
from specdec.tokenizer import TextTokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS = REPO_ROOT / "client" / "specdec_client" / "prompts" / "smoke.json"


def context_ids(tokenizer: TextTokenizer, length: int) -> np.ndarray:
    """`length` token ids of real text: the smoke prompts, concatenated and repeated."""
    texts = [text for group in json.loads(PROMPTS.read_text()).values() for text in group]
    ids: list[int] = []
    while len(ids) < length:
        for text in texts:
            ids.extend(tokenizer.encode(text))
    return np.asarray(ids[:length], dtype=np.int64)


def timed_batch(runtime: DecoderRuntime, items: list[ForwardItem]) -> float:
    start = time.perf_counter()
    runtime.forward(items)
    return time.perf_counter() - start


def measure_steps(pair: dict[str, tuple[DecoderRuntime, DecoderRuntime]], context: np.ndarray, k: int,
                  repeats: int, warmup: int, batch: int = 1) -> dict[str, dict[str, float]]:
    """Medians of one draft step, one target step and one verification pass of `batch` sequences (one
    padded forward, each sequence in its own slot at the same cache length)."""
    past = len(context) - 1
    step = [ForwardItem(b, past, context[-1:]) for b in range(batch)]
    verify = [ForwardItem(b, past, np.concatenate([context[-1:], context[:k]]), num_logits=k + 1)
              for b in range(batch)]
    samples: dict[str, dict[str, list[float]]] = {name: {"draft": [], "target": [], "verify": []} for name in pair}
    for target, draft in pair.values():
        for runtime in (target, draft):
            runtime.forward([ForwardItem(b, 0, context[:past]) for b in range(batch)])
    for r in range(warmup + repeats):
        for name, (target, draft) in pair.items():
            for key, runtime, item in (("draft", draft, step), ("target", target, step), ("verify", target, verify)):
                elapsed = timed_batch(runtime, item)
                if r >= warmup:
                    samples[name][key].append(elapsed)
    report = {}
    for name, per in samples.items():
        med = {key: statistics.median(values) * 1e3 for key, values in per.items()}
        report[name] = {
            "draft_step_ms": med["draft"], "target_step_ms": med["target"], "verify_step_ms": med["verify"],
            "c": med["draft"] / med["target"], "v": med["verify"] / med["target"],
        }
    return report


async def _generate(generator: SpeculativeGenerator, request: GenerationRequest, sequence_id: int,
                    stats: GenerationStats) -> int:
    count = 0
    async for update in generator.generate(request, sequence_id, stats):
        count += len(update.token_ids)
    return count


def measure_generation(pair: dict[str, tuple[DecoderRuntime, DecoderRuntime]], tokenizer: TextTokenizer,
                       k: int, max_tokens: int, rounds: int) -> dict[str, dict[str, float]]:
    prompts = [tokenizer.encode(text) for group in json.loads(PROMPTS.read_text()).values() for text in group[:2]]
    generators = {
        name: SpeculativeGenerator(InProcessBackend(TargetEngine(t, 60.0), DraftEngine(d, 60.0)), t.max_length)
        for name, (t, d) in pair.items()
    }
    times = {name: {"plain": 0.0, "spec": 0.0} for name in pair}
    tokens = {name: {"plain": 0, "spec": 0} for name in pair}
    stats = {name: GenerationStats() for name in pair}
    sequence_id = 1
    for _ in range(rounds):
        for prompt in prompts:
            for name, generator in generators.items():
                for mode, drafts in (("plain", 0), ("spec", k)):
                    sequence_id += 1
                    request = GenerationRequest(prompt, max_tokens, num_draft_tokens=drafts)
                    start = time.perf_counter()
                    sink = stats[name] if drafts else GenerationStats()
                    tokens[name][mode] += asyncio.run(_generate(generator, request, sequence_id, sink))
                    times[name][mode] += time.perf_counter() - start
    report = {}
    for name in pair:
        plain = tokens[name]["plain"] / times[name]["plain"]
        spec = tokens[name]["spec"] / times[name]["spec"]
        report[name] = {"plain_tok_s": plain, "spec_tok_s": spec, "speedup": spec / plain,
                        "acceptance_rate": stats[name].acceptance_rate}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, default=REPO_ROOT / "model_repository" / "target_model" / "1")
    parser.add_argument("--draft", type=Path, default=REPO_ROOT / "model_repository" / "draft_model" / "1")
    parser.add_argument("--runtimes", default="torch,onnxruntime", help="comma-separated runtime names")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine-dir", type=Path,
                        help="tensorrt: the --output-dir of build/build_engines.py (holds target_model/, draft_model/)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (the CPU deployment uses 1)")
    parser.add_argument("--context", type=int, default=128, help="cache length at which steps are timed")
    parser.add_argument("--k", type=int, default=6, help="draft tokens per verification pass")
    parser.add_argument("--batch", type=int, default=1, help="sequences per forward (concurrent generations)")
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--generate", action="store_true", help="also time whole generations")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)

    names = [name.strip() for name in args.runtimes.split(",") if name.strip()]
    max_length = max(args.context + args.k + 2, 512)
    def runtime(name: str, folder: Path, model: str) -> DecoderRuntime:
        engine_dir = args.engine_dir / model if name == "tensorrt" and args.engine_dir else None
        return build_runtime(name, folder, num_slots=max(args.batch, 1), max_length=max_length, device=args.device,
                             num_threads=args.threads, engine_dir=engine_dir)

    pair = {name: (runtime(name, args.target, "target_model"), runtime(name, args.draft, "draft_model"))
            for name in names}
    tokenizer = TextTokenizer(args.target)
    steps = measure_steps(pair, context_ids(tokenizer, args.context), args.k, args.repeats, args.warmup, args.batch)
    result: dict = {"setup": {key: str(value) for key, value in vars(args).items()}, "steps": steps}
    print(f"per-step medians at context {args.context}, k={args.k}, batch {args.batch}, {args.repeats} interleaved"
          f" repeats, {args.threads} thread(s):")
    print(f"  {'runtime':<12} {'draft ms':>9} {'target ms':>10} {'verify ms':>10} {'c':>6} {'v':>6}")
    for name, row in steps.items():
        print(f"  {name:<12} {row['draft_step_ms']:9.3f} {row['target_step_ms']:10.3f} {row['verify_step_ms']:10.3f}"
              f" {row['c']:6.3f} {row['v']:6.3f}")
    if len(names) > 1:
        base = steps[names[0]]
        for name in names[1:]:
            print(f"  {name} / {names[0]}: target step x{steps[name]['target_step_ms'] / base['target_step_ms']:.3f},"
                  f" draft step x{steps[name]['draft_step_ms'] / base['draft_step_ms']:.3f}")
    if args.generate:
        gen = measure_generation(pair, tokenizer, args.k, args.max_tokens, args.rounds)
        result["generation"] = gen
        print(f"greedy generation, {args.max_tokens} tokens per prompt, k={args.k}:")
        for name, row in gen.items():
            print(f"  {name:<12} plain {row['plain_tok_s']:7.1f} tok/s  speculative {row['spec_tok_s']:7.1f} tok/s"
                  f"  speedup {row['speedup']:.2f}  acceptance {row['acceptance_rate']:.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
