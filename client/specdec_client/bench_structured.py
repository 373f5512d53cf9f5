"""`structured-bench`: structured outputs (a JSON schema per request) with and without speculation.

Held-out chat requests (written for this benchmark, never trained on), each with a JSON schema of the object it
asks for: nested objects, arrays with min / max items, enums, numbers with ranges, strings with lengths and
patterns. Each request is sent, back to back, as constrained plain decoding (`num_draft_tokens` 0), constrained
speculative decoding (the default: the grammar's forced tokens and prompt lookup, profiles.yaml
`constrained_drafter`), the same with the EAGLE head in front of lookup (`drafter` eagle+ngram) and unconstrained
plain decoding, greedy and sampled (temperature 0.7, top_p 0.95, seed = the request's index),
through gRPC, unstreamed, at concurrency 1 (or `--concurrency` N: N copies of each request at once). Prints
output tokens/s per mode, the speedups, how many answers parse and validate, and the share of output tokens the
grammar drafted (from the server's metrics).

    python -m specdec_client.bench_structured --start-server [--out docs/bench/structured]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema

from specdec_client.api import generate_grpc
from specdec_client.scrape import scrape
from specdec_client.server import DEFAULT_MODEL_REPOSITORY, start_on_free_ports


def _obj(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


_STR = {"type": "string", "minLength": 1, "maxLength": 40}
REQUESTS: list[tuple[str, dict[str, Any]]] = [
    ("Produce a JSON object for a hotel booking: guest, nights, room_type and breakfast (a boolean).",
     _obj({"guest": _STR, "nights": {"type": "integer", "minimum": 1, "maximum": 30},
           "room_type": {"enum": ["single", "double", "suite"]}, "breakfast": {"type": "boolean"}})),
    ("Output a JSON list of three programming languages, each with name, year_created and typing.",
     {"type": "array", "minItems": 3, "maxItems": 3, "items": _obj({
         "name": _STR, "year_created": {"type": "integer", "minimum": 1950, "maximum": 2025},
         "typing": {"enum": ["static", "dynamic"]}})}),
    ("I need JSON for a weather report with fields location, temperature_c, humidity and wind_kmh.",
     _obj({"location": _STR, "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
           "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
           "wind_kmh": {"type": "number", "minimum": 0, "maximum": 400}})),
    ("Describe a smartphone as JSON with brand, model, storage_gb, price_usd and colors (a list).",
     _obj({"brand": _STR, "model": _STR, "storage_gb": {"enum": [64, 128, 256, 512]},
           "price_usd": {"type": "number", "minimum": 0},
           "colors": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 4}})),
    ("Create a JSON configuration for a web server: host, port, tls (an object) and routes (a list).",
     _obj({"host": _STR, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
           "tls": _obj({"enabled": {"type": "boolean"}, "certificate": _STR}),
           "routes": {"type": "array", "minItems": 1, "maxItems": 3, "items": _obj({
               "path": {"type": "string", "pattern": "^/[a-z0-9/]{0,20}$"}, "handler": _STR})}})),
    ("Represent a school class as JSON: teacher, room, and a list of four students with name and age.",
     _obj({"teacher": _STR, "room": _STR, "students": {"type": "array", "minItems": 4, "maxItems": 4, "items": _obj({
         "name": _STR, "age": {"type": "integer", "minimum": 5, "maximum": 19}})}})),
    ("Turn this into JSON: Maria, 34, nurse, lives in Porto, speaks Portuguese and English.",
     _obj({"name": _STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "occupation": _STR,
           "city": _STR, "languages": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 5}})),
    ("Give a JSON object for a flight with number, origin, destination, departure time and seats left.",
     _obj({"number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2,4}$"},
           "origin": {"type": "string", "minLength": 3, "maxLength": 3},
           "destination": {"type": "string", "minLength": 3, "maxLength": 3},
           "departure": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
           "seats_left": {"type": "integer", "minimum": 0, "maximum": 500}})),
]
MODES = {"constrained plain": {"num_draft_tokens": 0}, "constrained speculative": {},
         "constrained speculative, head": {"drafter": "eagle+ngram"},
         "unconstrained plain": {"num_draft_tokens": 0, "guide": False}}
DECODINGS = {"greedy": {}, "T 0.7 top_p 0.95": {"temperature": 0.7, "top_p": 0.95}}
GRAMMAR_ACCEPTED = "specdec_grammar_accepted_draft_tokens_total"
OUTPUT_TOKENS = "specdec_output_tokens_total"


def chat_prompts(model_repository: Path) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_repository / "target_model" / "1")
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True) for text, _ in REQUESTS]


def valid(text: str, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def measure(url: str, metrics_url: str, prompts: list[str], max_tokens: int, concurrency: int) -> dict:
    """{(decoding, mode): {"tokens", "seconds", "valid", "answers", "forced"}} over every request."""
    totals: dict[tuple[str, str], dict[str, float]] = {}
    with ThreadPoolExecutor(concurrency) as pool:
        for index, (prompt, (_, schema)) in enumerate(zip(prompts, REQUESTS, strict=True)):
            for decoding, sampling in DECODINGS.items():
                for mode, options in MODES.items():
                    params = {"text_input": prompt, "max_tokens": max_tokens, "exclude_input_in_output": True,
                              "task": "json", **sampling, **({"seed": index} if sampling else {})}
                    if options.get("guide", True):
                        params.update(guided_decoding_guide_type="json_schema",
                                      guided_decoding_guide=json.dumps(schema))
                    params.update({k: v for k, v in options.items() if k != "guide"})
                    before = scrape(metrics_url)
                    results = list(pool.map(lambda p: generate_grpc(url, p), [params] * concurrency))
                    after = scrape(metrics_url)
                    cell = totals.setdefault((decoding, mode), dict.fromkeys(
                        ("tokens", "seconds", "valid", "answers", "forced", "counted"), 0.0))
                    cell["tokens"] += sum(r.num_output_tokens for r in results)
                    cell["seconds"] += max(r.latency_s for r in results)  # the wall time of the set
                    cell["valid"] += sum(valid(r.text, schema) for r in results)
                    cell["answers"] += len(results)
                    cell["forced"] += after.total(GRAMMAR_ACCEPTED) - before.total(GRAMMAR_ACCEPTED)
                    cell["counted"] += after.total(OUTPUT_TOKENS) - before.total(OUTPUT_TOKENS)
    return totals


def report(totals: dict, concurrency: int) -> str:
    lines = [f"concurrency {concurrency}, {len(REQUESTS)} held-out schemas",
             "| decoding | mode | output tok/s | ÷ constrained plain | ÷ unconstrained plain | valid "
             "| grammar-drafted |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for decoding in DECODINGS:
        rate = {mode: totals[(decoding, mode)]["tokens"] / totals[(decoding, mode)]["seconds"] for mode in MODES}
        for mode in MODES:
            cell = totals[(decoding, mode)]
            forced = cell["forced"] / cell["counted"] if cell["counted"] else 0.0
            lines.append(f"| {decoding} | {mode} | {rate[mode]:.1f} | {rate[mode] / rate['constrained plain']:.2f}× | "
                         f"{rate[mode] / rate['unconstrained plain']:.2f}× | "
                         f"{int(cell['valid'])}/{int(cell['answers'])} | {forced:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="gRPC host:port of a running server (with --metrics-url)")
    parser.add_argument("--metrics-url", help="its Prometheus endpoint, e.g. http://127.0.0.1:8002/metrics")
    parser.add_argument("--start-server", action="store_true")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--out", type=Path, help="a folder for results.json and results.md")
    args = parser.parse_args(argv)
    if not (args.url and args.metrics_url) and not args.start_server:
        parser.error("give --url and --metrics-url, or --start-server")
    prompts = chat_prompts(args.model_repository)
    log = Path(tempfile.gettempdir()) / "structured_bench_server.log"
    server = start_on_free_ports(args.model_repository, log) if args.start_server else None
    try:
        totals = measure(server.grpc_url if server else args.url, server.metrics_url if server else args.metrics_url,
                         prompts, args.max_tokens, args.concurrency)
    finally:
        if server is not None:
            server.stop()
    table = report(totals, args.concurrency)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(
            {f"{decoding} / {mode}": cell for (decoding, mode), cell in totals.items()}, indent=1) + "\n")
        (args.out / "results.md").write_text(table + "\n\nCommand: `python -m specdec_client.bench_structured "
                                             f"--start-server --max-tokens {args.max_tokens} --concurrency "
                                             f"{args.concurrency}`\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
