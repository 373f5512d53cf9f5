"""`typical-quality`: what typical acceptance (lossy) does to the output, against plain greedy decoding.

Typical acceptance keeps a draft token x when p(x) >= threshold x max p, so its output drifts from the
target's greedy text wherever the draft proposes a near-tie. Per scenario of held-out chat requests
(`prompts/bench_chat.json`), the same server answers each request with plain greedy decoding and with
`acceptance=typical` at each threshold (interleaved per request). Reported per scenario and mode:

- JSON: the share of answers holding a JSON value that parses (the first ```json fence, else the first
  {...} or [...] span);
- code: the share of answers whose Python parses with `ast.parse` (the ```python fences, else the answer);
- every scenario: corpus BLEU (sacrebleu) of the answers against plain decoding's, the share of answers
  equal to plain's, tok/s and the speedup over plain, alpha.

    typical-quality --start-server --prompts-per-scenario 4 --thresholds 0.7,0.5 --out bench_results/typical
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

from specdec_client.api import generate_grpc
from specdec_client.server import REPO_ROOT, start_on_free_ports

CHAT_PROMPTS = REPO_ROOT / "client" / "specdec_client" / "prompts" / "bench_chat.json"
_FENCE = re.compile(r"```(?P<lang>[A-Za-z0-9_+-]*)[ \t]*\n(?P<body>.*?)(?:```|\Z)", re.DOTALL)


def fenced(text: str, languages: tuple[str, ...]) -> list[str]:
    """Bodies of the markdown code fences tagged with one of `languages` (or untagged)."""
    return [m["body"] for m in _FENCE.finditer(text) if m["lang"].lower() in (*languages, "")]


def json_value(text: str) -> str | None:
    """The JSON the answer holds: its first ```json fence, else its first {...} or [...] span."""
    blocks = fenced(text, ("json",))
    if blocks:
        return blocks[0]
    starts = [i for i in (text.find("{"), text.find("[")) if i >= 0]
    if not starts:
        return None
    start = min(starts)
    end = max(text.rfind("}"), text.rfind("]"))
    return text[start:end + 1] if end > start else None


def json_parses(text: str) -> bool:
    value = json_value(text)
    if value is None:
        return False
    try:
        json.loads(value)
    except json.JSONDecodeError:
        return False
    return True


def python_parses(text: str) -> bool:
    """Whether the answer's Python (its ```python fences joined, else the whole answer) parses."""
    code = "\n".join(fenced(text, ("python", "py"))) or text
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


VALIDITY = {"json": ("json_valid", json_parses), "code": ("python_parses", python_parses)}


def run(url: str, scenarios: dict, per_scenario: int, thresholds: list[float]) -> dict[str, dict[str, list[dict]]]:
    modes = {"plain": {"num_draft_tokens": 0},
             **{f"typical {t}": {"acceptance": "typical", "verify_threshold": t} for t in thresholds}}
    work = [(name, prompt) for name, spec in scenarios.items() for prompt in spec["prompts"][:per_scenario]]
    results: dict[str, dict[str, list[dict]]] = {}
    order = list(modes)
    with tqdm(total=len(work) * len(modes), desc="typical-quality", file=sys.stderr) as bar:
        for index, (name, prompt) in enumerate(work):
            spec = scenarios[name]
            for mode in (order if index % 2 == 0 else order[::-1]):
                result = generate_grpc(url, {"text_input": prompt["prompt"], "max_tokens": spec["max_tokens"],
                                             "task": spec["task"], "exclude_input_in_output": True, **modes[mode]})
                results.setdefault(name, {}).setdefault(mode, []).append({
                    "id": prompt["id"], "text": result.text, "tokens": result.num_output_tokens,
                    "latency_s": result.latency_s, "accepted": result.stats.get("total_accepted_draft_tokens", 0),
                    "drafted": result.stats.get("total_draft_tokens", 0)})
                bar.update()
    return results


def summarise(results: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, dict]]:
    import sacrebleu

    summary: dict[str, dict[str, dict]] = {}
    for name, modes in results.items():
        plain = modes["plain"]
        plain_tps = statistics.median(r["tokens"] / r["latency_s"] for r in plain)
        for mode, records in modes.items():
            tps = statistics.median(r["tokens"] / r["latency_s"] for r in records)
            drafted = sum(r["drafted"] for r in records)
            row = {
                "requests": len(records),
                "tokens_per_s": round(tps, 1),
                "speedup": round(tps / plain_tps, 2),
                "alpha": round(sum(r["accepted"] for r in records) / drafted, 3) if drafted else None,
                "equal_to_plain": sum(r["text"] == p["text"] for r, p in zip(records, plain, strict=True)),
                "bleu_vs_plain": round(sacrebleu.corpus_bleu([r["text"] for r in records],
                                                             [[p["text"] for p in plain]]).score, 1),
            }
            if name in VALIDITY:
                key, check = VALIDITY[name]
                row[key] = sum(check(r["text"]) for r in records)
            summary.setdefault(name, {})[mode] = row
    return summary


def markdown(summary: dict[str, dict[str, dict]]) -> str:
    lines = ["| scenario | mode | requests | valid (JSON parses / Python parses) | equal to plain | BLEU vs plain "
             "| tok/s | speedup | α |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, modes in summary.items():
        for mode, row in modes.items():
            valid = row.get("json_valid", row.get("python_parses"))
            lines.append(f"| {name} | {mode} | {row['requests']} | {'-' if valid is None else valid} "
                         f"| {row['equal_to_plain']} | {row['bleu_vs_plain']} | {row['tokens_per_s']} "
                         f"| {row['speedup']:.2f}x | {'-' if row['alpha'] is None else row['alpha']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="127.0.0.1:8001", help="gRPC host:port of a running server")
    parser.add_argument("--start-server", action="store_true", help="start a server on free ports for the run")
    parser.add_argument("--model-repository", type=Path, default=REPO_ROOT / "model_repository")
    parser.add_argument("--prompts", type=Path, default=CHAT_PROMPTS)
    parser.add_argument("--prompts-per-scenario", type=int, default=4)
    parser.add_argument("--thresholds", type=lambda s: [float(x) for x in s.split(",")], default=[0.7])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench_results" / "typical")
    args = parser.parse_args(argv)
    scenarios = json.loads(args.prompts.read_text(encoding="utf-8"))["scenarios"]
    args.out.mkdir(parents=True, exist_ok=True)
    server = None
    url = args.url
    try:
        if args.start_server:
            server = start_on_free_ports(args.model_repository, args.out / "server.log")
            url = server.grpc_url
        results = run(url, scenarios, args.prompts_per_scenario, args.thresholds)
    finally:
        if server is not None:
            server.stop()
    summary = summarise(results)
    table = markdown(summary)
    (args.out / "typical.json").write_text(json.dumps({"summary": summary, "records": results}, indent=1,
                                                      ensure_ascii=False))
    (args.out / "typical.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
