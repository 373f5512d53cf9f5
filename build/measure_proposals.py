"""How drafting choices change what one target call yields, without a server: greedy speculation in this
process (the served runtimes: onnxruntime with each model's `num_threads` and `weight_quantization` from its
config.pbtxt) over the held-out chat requests, per drafter
setting. For each it prints tokens per target call, rows verified per call, the head's forwards, prompt
lookup's accepted / proposed tokens, and a speedup estimated from the costs measured in the same run (a
least-squares fit of target time to rows verified, and of head time to its forwards). Outputs are checked
equal across settings (greedy speculation is lossless).

A setting is ``drafter:k[:lookup_length:min_ngram[:confidence]]``, e.g. ``eagle+ngram:4:12:2:0.5``; k
``profile`` takes each task profile's length, a lookup length ending in ``a`` (``12a``) is adaptive up to it
(no lookup fields: the profile's prompt_lookup). A drafter written ``eagle+ngram@NODESxWIDTH``
(``eagle+ngram@6x2:4``) drafts a dynamic tree of NODES nodes, WIDTH per level, k deep, with no node whose path
probability is below the confidence (default 0); other drafters draft chains of k.
``--confidence K`` instead
drafts K tokens with the head per iteration and prints how often the first drafted token is accepted per band
of the head's own probability for it, and how early stopping at a probability threshold would have done
(docs/SPECULATION.md, "What did not pay"). Usage::

    python build/measure_proposals.py --prompts 3 eagle+ngram:profile:12:2 eagle+ngram:profile:6:2
    python build/measure_proposals.py --prompts 4 --confidence 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python_backend"))

from specdec.config import DynamicTree, SpeculationConfig, SpeculationSettings  # noqa: E402
from specdec.drafting.base import proposal_of_tree  # noqa: E402
from specdec.drafting.ngram import PromptLookup  # noqa: E402
from specdec.engines import DraftEngine, StepRequest, StepResult, TargetEngine  # noqa: E402
from specdec.generation import GenerationRequest, GenerationStats, SpeculativeGenerator  # noqa: E402
from specdec.inprocess import InProcessBackend  # noqa: E402
from specdec.runtime import build_runtime  # noqa: E402
from specdec.tokenizer import TextTokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_onnx import configured_parameter, configured_quantization  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "client/specdec_client/prompts/bench_chat.json"
PROFILES = ROOT / "model_repository/speculative_decoding/1/profiles.yaml"
MAX_LENGTH = 2048
DECODE_ROWS = 64  # a target call with more input rows is a prefill, left out of the cost fit
BANDS = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.01)


class RecordingBackend(InProcessBackend):
    """Times every decode call; with `confidence`, asks the head for its logits and keeps its probabilities."""

    def __init__(self, target: TargetEngine, eagle: DraftEngine, confidence: bool) -> None:
        super().__init__(target, None, eagle)
        self.confidence = confidence
        self.target_calls: list[tuple[int, float]] = []  # (rows, seconds)
        self.head_calls: list[tuple[int, float]] = []  # (head forwards, seconds)
        self.last_probabilities: list[float] = []

    async def target_step(self, request: StepRequest) -> StepResult:
        started = time.perf_counter()
        result = await super().target_step(request)
        if 0 < len(request.input_ids) <= DECODE_ROWS:
            self.target_calls.append((len(request.input_ids), time.perf_counter() - started))
        return result

    async def drafter_step(self, drafter: str, request: StepRequest) -> StepResult:
        if request.num_draft_tokens and self.confidence:
            request.want_logits = True
        started = time.perf_counter()
        result = await super().drafter_step(drafter, request)
        if request.num_draft_tokens:
            # The head's forwards: one per kept token, and one more that scored a token dropped by the floor.
            kept = len(result.token_ids)
            forwards = kept + int(kept < request.num_draft_tokens * request.num_candidates)
            if result.parents is not None:  # a dynamic tree: one forward per level (at least its depth)
                forwards = proposal_of_tree(result.token_ids, result.parents).depth
            self.head_calls.append((forwards, time.perf_counter() - started))
            if self.confidence and result.logits is not None:
                logits = result.logits.astype(np.float64)
                p = np.exp(logits - logits.max(-1, keepdims=True))
                self.last_probabilities = (p.max(-1) / p.sum(-1)).tolist()
        return result


def fit(calls: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed, per unit) seconds of a least-squares line through (units, seconds)."""
    x = np.array([c[0] for c in calls], dtype=float)
    y = np.array([c[1] for c in calls])
    if len(set(x)) < 2:
        return float(np.median(y)), 0.0
    per_unit, fixed = np.polyfit(x, y, 1)
    return float(fixed), float(per_unit)


def generate(backend: RecordingBackend, prompt: list[int], max_tokens: int, settings: SpeculationSettings,
             stats: GenerationStats) -> list[int]:
    generator = SpeculativeGenerator(backend, MAX_LENGTH)

    async def run() -> list[int]:
        tokens: list[int] = []
        async for update in generator.generate(GenerationRequest(prompt, max_tokens, settings=settings), 1, stats):
            tokens += update.token_ids
        return tokens

    return asyncio.run(run())


def settings_of(spec: str, task: str = "text") -> SpeculationSettings:
    parts = spec.split(":")
    drafter = parts[0]
    config = SpeculationConfig.load(PROFILES)
    profile = config.profiles[task]
    k = profile.min_length if parts[1] == "profile" else int(parts[1])
    lookup = config.prompt_lookup  # the profile's
    if len(parts) >= 4:
        length = parts[2]
        lookup = PromptLookup(int(length.rstrip("a")), int(parts[3]), adaptive=length.endswith("a"))
    floor = float(parts[4]) if len(parts) >= 5 else 0.0
    tree = None
    if "@" in drafter:  # eagle+ngram@NODESxWIDTH: a dynamic tree, k deep, the confidence its least path probability
        drafter, shape = drafter.split("@")
        nodes, width = (int(v) for v in shape.split("x"))
        tree = DynamicTree(nodes, k, width, floor)
    elif floor:
        raise SystemExit(f"{spec}: a confidence floors a dynamic tree (drafter@NODESxWIDTH), not a chain")
    return SpeculationSettings("text", drafter, k, k, 1, "greedy", 0.7, explicit_length=True,
                               prompt_lookup=lookup, tree=tree)


def served_runtime(model_dir: Path):
    """The onnxruntime decoder of a repository model with the threads and weights its config.pbtxt serves."""
    threads = int(configured_parameter(model_dir, "num_threads") or 1)
    quantization = configured_quantization(model_dir)
    print(f"{model_dir.parent.name}: {threads} thread(s), weights {quantization or 'as exported'}", flush=True)
    return build_runtime("onnxruntime", model_dir, 2, MAX_LENGTH, num_threads=threads,
                         weight_quantization=quantization)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("settings", nargs="*", help="drafter:k[:lookup_length:min_ngram]")
    ap.add_argument("--prompts", type=int, default=3, help="held-out chat requests per domain")
    ap.add_argument("--confidence", type=int, default=0, help="study the head's confidence drafting this many")
    ap.add_argument("--repository", type=Path, default=ROOT / "model_repository")
    ap.add_argument("--domains", default="json,code,prose", help="comma-separated scenarios to run")
    args = ap.parse_args(argv)
    if not args.settings and not args.confidence:
        ap.error("name settings to compare, or --confidence K")
    scenarios = json.loads(PROMPTS.read_text(encoding="utf-8"))["scenarios"]
    domains = args.domains.split(",")
    if unknown := set(domains) - set(scenarios):
        ap.error(f"--domains: no scenario {', '.join(sorted(unknown))} (there are {', '.join(scenarios)})")
    target = TargetEngine(served_runtime(args.repository / "target_model/1"), 60)
    head = DraftEngine(served_runtime(args.repository / "eagle_draft/1"), 60)
    tokenizer = TextTokenizer(args.repository / "target_model/1")
    report: dict = {}
    for domain, scenario in scenarios.items():
        if domain not in domains:
            continue
        prompts = [tokenizer.encode(p["prompt"]) for p in scenario["prompts"][:args.prompts]]
        if args.confidence:
            report[domain] = confidence_study(target, head, prompts, scenario["max_tokens"], args.confidence)
            continue
        outputs = {}
        for spec in args.settings:
            backend = RecordingBackend(target, head, confidence=False)
            stats = GenerationStats()
            settings = settings_of(spec, scenario["task"])
            started = time.perf_counter()
            outputs[spec] = [generate(backend, p, scenario["max_tokens"], settings, stats) for p in prompts]
            wall = time.perf_counter() - started
            t_fixed, t_row = fit(backend.target_calls)
            h_fixed, h_token = fit(backend.head_calls) if backend.head_calls else (0.0, 0.0)
            calls = len(backend.target_calls)
            rows = sum(c[0] for c in backend.target_calls)
            drafted = sum(c[0] for c in backend.head_calls)
            spent = t_fixed * calls + t_row * rows + h_fixed * len(backend.head_calls) + h_token * drafted
            plain = (t_fixed + t_row) * stats.output_tokens  # one row per token
            row = {"tokens_per_call": stats.output_tokens / calls, "rows_per_call": rows / calls,
                   "head_forwards": drafted, "lookup_accepted": stats.lookup_accepted_tokens,
                   "lookup_proposed": stats.lookup_draft_tokens, "estimated_speedup": plain / spent,
                   "tokens_per_s": stats.output_tokens / wall}
            report.setdefault(domain, {})[spec] = row
            print(f"{domain:6s} {spec:22s} tokens/call {row['tokens_per_call']:.2f} rows/call "
                  f"{row['rows_per_call']:.2f} head forwards {drafted} lookup {stats.lookup_accepted_tokens}/"
                  f"{stats.lookup_draft_tokens} estimated speedup {row['estimated_speedup']:.2f}x "
                  f"measured {row['tokens_per_s']:.1f} tok/s; per call: target "
                  f"{1000 * sum(c[1] for c in backend.target_calls) / max(calls, 1):.1f} ms, head "
                  f"{1000 * sum(c[1] for c in backend.head_calls) / max(len(backend.head_calls), 1):.1f} ms",
                  flush=True)
        first = next(iter(outputs.values()))
        if any(out != first for out in outputs.values()):
            raise SystemExit(f"{domain}: greedy outputs differ between settings")
    return report


def stopping_policies(iterations: list[tuple[list[float], int]], k: int, t_fixed: float, t_row: float,
                      head_token: float) -> dict[str, dict[str, float]]:
    """Each policy applied to the same iterations (the head's probability of each of the k drafted tokens, and
    how many the target accepted): a fixed length, or drafting on while the head's probability stays at or above
    a threshold (the first token always). A policy keeping n tokens accepts min(accepted, n). The speedup is
    estimated from the costs: a target call t_fixed + t_row per row verified, head_token per head forward."""
    policies = {f"k={n}": [min(n, len(p)) for p, _ in iterations] for n in sorted({1, 2, 3, k})}
    floors = {f"p>={threshold}": threshold for threshold in (0.3, 0.5, 0.7, 0.9)}
    for name, threshold in floors.items():
        policies[name] = [next((j for j in range(1, len(p)) if p[j] < threshold), len(p)) for p, _ in iterations]
    out = {}
    for name, kept in policies.items():
        gained = sum(min(a, n) for (_, a), n in zip(iterations, kept, strict=True)) / len(iterations)
        drafted = sum(kept) / len(iterations)
        # A floor that stopped a chain also ran the forward that scored the dropped token.
        forwards = drafted + (sum(n < len(p) for (p, _), n in zip(iterations, kept, strict=True)) / len(iterations)
                              if name in floors else 0.0)
        spent = t_fixed + t_row * (1 + drafted) + head_token * forwards
        out[name] = {"accepted_per_iteration": round(gained, 3), "drafted_per_iteration": round(drafted, 3),
                     "estimated_speedup": round((1 + gained) * (t_fixed + t_row) / spent, 3)}
    return out


def confidence_study(target: TargetEngine, head: DraftEngine, prompts: list[list[int]], max_tokens: int,
                     k: int) -> dict:
    """Per iteration: the head's probability of each drafted token and how many were accepted."""
    backend = RecordingBackend(target, head, confidence=True)
    iterations: list[tuple[list[float], int]] = []
    stats = GenerationStats()
    record = stats.record_verification

    def recording(depth: int, accepted: int) -> None:
        iterations.append((backend.last_probabilities, accepted))
        record(depth, accepted)

    stats.record_verification = recording  # type: ignore[method-assign]
    for prompt in prompts:
        generate(backend, prompt, max_tokens, settings_of(f"eagle:{k}"), stats)
    first = np.array([p[0] for p, _ in iterations])
    accepted = np.array([a >= 1 for _, a in iterations])
    bands = {}
    for lo, hi in zip(BANDS, BANDS[1:], strict=False):
        inside = (first >= lo) & (first < hi)
        if inside.any():
            bands[f"{lo:.1f}-{min(hi, 1.0):.1f}"] = {"iterations": int(inside.sum()),
                                                   "first_accepted": round(float(accepted[inside].mean()), 3)}
    t_fixed, t_row = fit(backend.target_calls)
    head_token = float(np.median([seconds / n for n, seconds in backend.head_calls]))
    stopping = stopping_policies(iterations, k, t_fixed, t_row, head_token)
    print(json.dumps({"iterations": len(iterations), "first_token_bands": bands, "stopping": stopping}))
    return {"bands": bands, "stopping": stopping}


if __name__ == "__main__":
    main()
