"""`option-cost`: what a request option costs at concurrency 1 (issue: none should cost more than 10%).

Each held-out chat request (`prompts/bench_chat.json`, the first `--per-domain` of each domain) is sent once
without options and once with each option, back to back, through gRPC, unstreamed, at the default profiles
(greedy unless an option samples); prints output tokens/s per option and its ratio to no option, and what
that ratio is made of: the tokens each verification accepted (an option that changes the answers changes what
the drafters find to propose) and the time a verification took (the option's own processing).

    python -m specdec_client.option_cost --start-server
    python -m specdec_client.option_cost --url 127.0.0.1:8001 --per-domain 8
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from specdec_client.api import generate_grpc
from specdec_client.bench_prompts import CHAT_PROMPTS_FILE
from specdec_client.server import DEFAULT_MODEL_REPOSITORY, start_on_free_ports

OPTIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "frequency_penalty 0.3": {"frequency_penalty": 0.3},
    "presence_penalty 0.3": {"presence_penalty": 0.3},
    "repetition_penalty 1.1": {"repetition_penalty": 1.1},
    "logit_bias (one token -100)": {"logit_bias_ids": [0], "logit_bias_values": [-100.0]},
    "bad_words": {"bad_words": ["never appears here"]},
    "stop_words": {"stop_words": ["never appears here"]},
    "return_log_probs (5 alternatives)": {"return_log_probs": True, "num_top_log_probs": 5},
}


def measure(url: str, per_domain: int, max_tokens: int,
            names: list[str] | None = None) -> dict[str, tuple[int, float, int]]:
    """Per option (`names`: these, "none" first; None: all): (output tokens, seconds, verifications) over the
    requests."""
    scenarios = json.loads(CHAT_PROMPTS_FILE.read_text())["scenarios"]
    requests = [(s["task"], p["prompt"]) for s in scenarios.values() for p in s["prompts"][:per_domain]]
    chosen = {name: OPTIONS[name] for name in ["none", *(n for n in (names or OPTIONS) if n != "none")]}
    totals = {name: (0, 0.0, 0) for name in chosen}
    for task, prompt in requests:
        for name, extra in chosen.items():
            result = generate_grpc(url, {"text_input": prompt, "max_tokens": max_tokens, "task": task,
                                         "exclude_input_in_output": True, **extra})
            tokens, seconds, passes = totals[name]
            totals[name] = (tokens + result.num_output_tokens, seconds + result.latency_s,
                            passes + int(result.stats.get("total_verification_passes", 0)))
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="gRPC host:port of a running server")
    parser.add_argument("--start-server", action="store_true")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--per-domain", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--options", help=f"comma-separated option names (default: all of {list(OPTIONS)}); the "
                        "requests without options always run beside them")
    args = parser.parse_args(argv)
    if not args.url and not args.start_server:
        parser.error("give --url or --start-server")
    names = [n.strip() for n in args.options.split(",")] if args.options else None
    unknown = [n for n in names or [] if n not in OPTIONS]
    if unknown:
        parser.error(f"--options: unknown {unknown}; known: {list(OPTIONS)}")
    log = Path(tempfile.gettempdir()) / "option_cost_server.log"
    server = start_on_free_ports(args.model_repository, log) if args.start_server else None
    try:
        totals = measure(server.grpc_url if server else args.url, args.per_domain, args.max_tokens, names)
    finally:
        if server is not None:
            server.stop()
    base_tokens, base_seconds, base_passes = totals["none"]
    print("| option | output tok/s | ÷ none | tokens per verification (none's) | ms per verification ÷ none's "
          "| output tokens |\n| --- | --- | --- | --- | --- | --- |")
    for name, (tokens, seconds, passes) in totals.items():
        per_pass = f"{tokens / passes:.2f} ({base_tokens / base_passes:.2f})" if passes and base_passes else "-"
        pass_cost = f"{(seconds / passes) / (base_seconds / base_passes):.2f}×" if passes and base_passes else "-"
        print(f"| {name} | {tokens / seconds:.1f} | {tokens / seconds / (base_tokens / base_seconds):.2f}× "
              f"| {per_pass} | {pass_cost} | {tokens} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
