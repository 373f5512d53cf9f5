"""`compare-modes`: chain vs tree vs n-gram drafting against plain decoding, per scenario, in one run.

Modes: the task profile's drafter as a chain and as a tree of 3 candidates, the EAGLE head alone (a chain
of the profile's k), and prompt lookup alone (12 tokens, the length it proposes in front of a model drafter).
Same server, same prompts, modes interleaved per prompt (plain, chain, tree, n-gram, then the reverse
order on the next round) so machine drift hits every mode alike. Greedy, concurrency 1. Reports per
scenario and mode: output tokens/s (median over requests), speedup over plain, alpha (accepted / proposed
draft tokens) and tau (tokens per target pass, from the response statistics).

    compare-modes --start-server --prompts-per-scenario 4 --out bench_results/modes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from specdec_client.api import generate_grpc
from specdec_client.bench_prompts import PROMPTS_FILE
from specdec_client.server import REPO_ROOT, TritonServer, free_port

# mode -> request parameters on top of the scenario's task profile (None: the profile's own value).
MODES: dict[str, dict] = {
    "plain": {"num_draft_tokens": 0},
    "chain": {"num_candidates": 1},
    "tree": {"num_candidates": 3},
    "eagle": {"drafter": "eagle", "num_candidates": 1},
    "ngram": {"drafter": "ngram", "num_draft_tokens": 12},
}


def k_sweep_modes(lengths: list[int]) -> dict[str, dict]:
    """Plain decoding and fixed-length chains (`num_draft_tokens` k, one candidate)."""
    return {"plain": MODES["plain"], **{f"k={k}": {"num_draft_tokens": k, "num_candidates": 1} for k in lengths}}


def run(url: str, scenarios: dict, per_scenario: int, rounds: int, max_tokens: int | None,
        modes: dict[str, dict] = MODES) -> dict:
    results: dict[str, dict[str, list[dict]]] = {}
    work = [(name, prompt) for name, spec in scenarios.items() for prompt in spec["prompts"][:per_scenario]]
    order = list(modes)
    with tqdm(total=len(work) * rounds * len(modes), desc="compare-modes", file=sys.stderr) as bar:
        for round_index in range(rounds):
            for name, prompt in work:
                spec = scenarios[name]
                for mode in (order if round_index % 2 == 0 else order[::-1]):
                    text = prompt["prompt"] if isinstance(prompt, dict) else prompt  # prompt files list {id, prompt}
                    params = {"text_input": text, "max_tokens": max_tokens or spec["max_tokens"],
                              "task": spec["task"], "exclude_input_in_output": True, **modes[mode]}
                    result = generate_grpc(url, params)
                    results.setdefault(name, {}).setdefault(mode, []).append({
                        "tokens": result.num_output_tokens, "latency_s": result.latency_s,
                        "accepted": result.stats.get("total_accepted_draft_tokens", 0),
                        "drafted": result.stats.get("total_draft_tokens", 0),
                    })
                    bar.update()
    return results


def summarise(results: dict) -> dict:
    summary: dict[str, dict[str, dict]] = {}
    for name, modes in results.items():
        plain_tps = statistics.median(r["tokens"] / r["latency_s"] for r in modes["plain"])
        for mode, records in modes.items():
            tps = statistics.median(r["tokens"] / r["latency_s"] for r in records)
            drafted = sum(r["drafted"] for r in records)
            accepted = sum(r["accepted"] for r in records)
            summary.setdefault(name, {})[mode] = {
                "tokens_per_s": round(tps, 1),
                "speedup": round(tps / plain_tps, 2),
                "alpha": round(accepted / drafted, 3) if drafted else None,
                "requests": len(records),
            }
    return summary


def markdown(summary: dict) -> str:
    lines = ["| scenario | mode | tok/s | speedup vs plain | alpha |", "| --- | --- | --- | --- | --- |"]
    for name, modes in summary.items():
        for mode, row in modes.items():
            alpha = "-" if row["alpha"] is None else f"{row['alpha']:.3f}"
            lines.append(f"| {name} | {mode} | {row['tokens_per_s']} | {row['speedup']:.2f}x | {alpha} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="127.0.0.1:8001")
    parser.add_argument("--start-server", action="store_true")
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--prompts", type=Path, default=PROMPTS_FILE)
    parser.add_argument("--prompts-per-scenario", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=None, help="override the scenario's new tokens")
    parser.add_argument("--scenarios", type=lambda s: s.split(","), default=None, help="e.g. json,code")
    parser.add_argument("--k-sweep", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="instead of the drafter modes: plain vs chains of these fixed lengths, e.g. 4,5,6,7,8")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "modes")
    args = parser.parse_args(argv)
    scenarios = json.loads(args.prompts.read_text(encoding="utf-8"))["scenarios"]
    if args.scenarios:
        scenarios = {name: scenarios[name] for name in args.scenarios}
    modes = k_sweep_modes(args.k_sweep) if args.k_sweep else MODES
    if not (args.model_repository / "eagle_draft" / "1" / "config.json").is_file():
        modes = {name: params for name, params in modes.items() if name != "eagle"}  # no head is served there
    server = None
    url = args.url
    if args.start_server:
        server = TritonServer(model_repository=args.model_repository, http_port=free_port(),
                              grpc_port=free_port(), metrics_port=free_port()).start()
        url = server.grpc_url
    try:
        results = run(url, scenarios, args.prompts_per_scenario, args.rounds, args.max_tokens, modes)
    finally:
        if server is not None:
            server.stop()
    summary = summarise(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "modes.json").write_text(json.dumps({"summary": summary, "records": results}, indent=1))
    table = markdown(summary)
    (args.out / "modes.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
