"""Extract the benchmark's held-out prompts from the training corpora's validation split.

The corpora (data/corpora/<domain>/valid.jsonl, made by build/corpora.py) are git-ignored; this script
turns them into committed inputs, deterministically:

- `client/specdec_client/prompts/bench.json`: prompts per scenario (json, code, prose) for `bench`;
- `client/perf/<scenario>.json`: perf_analyzer `--input-data` files against `ensemble` (streaming);
- `client/perf/genai_perf_<scenario>.jsonl`: genai-perf `--input-file` prompts.

A prompt is the opening of one held-out document (never one the models were trained on), cut at a natural
boundary (a line end for code and JSON, a sentence end for prose) so the continuation is the rest of it.

    python -m specdec_client.bench_prompts --corpora data/corpora
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path

from specdec_client.server import REPO_ROOT

# The decoding modes the benchmarks send, by name. top_p is sent explicitly: at the ensemble (TensorRT-LLM's
# semantics) top_k and top_p both 0 or absent mean greedy.
SAMPLINGS = {"greedy": {"temperature": 0.0}, "t0.7": {"temperature": 0.7, "top_p": 0.95},
             "t1.0": {"temperature": 1.0, "top_p": 1.0}}

# Scenario -> (corpus domain, server task, new tokens). The article's three scenarios.
SCENARIOS: dict[str, tuple[str, str, int]] = {
    "json": ("json", "json", 128),
    "code": ("code", "code", 256),
    "prose": ("prose", "text", 512),
}
PROMPTS_FILE = REPO_ROOT / "client" / "specdec_client" / "prompts" / "bench.json"
PERF_DIR = REPO_ROOT / "client" / "perf"
PROMPTS_PER_SCENARIO = 16
MIN_CHARS, MAX_CHARS = 120, 600
MAX_PROMPT_TOKENS = 256  # prompt + 512 new tokens stay inside the 1024-token context

_DEF = re.compile(r"^(?:async def|def|class) \w", re.M)
_SENTENCE_END = re.compile(r"[.!?;:][\"”’)]?\s")


def _rank(doc_id: str) -> str:
    return hashlib.sha256(doc_id.encode()).hexdigest()


def _group(doc: dict[str, str]) -> str:
    """What prompts are spread over: the source, and for the stdlib its package (not five codec tables)."""
    parts = doc["id"].split("/")
    return f"{parts[0]}/{parts[1]}" if doc["source"] == "stdlib" and len(parts) > 2 else doc["source"]


def _cut_lines(text: str, start: int = 0) -> str | None:
    """From `start`, whole lines up to MAX_CHARS, at least MIN_CHARS; None if the document is too short."""
    piece = text[start:start + MAX_CHARS]
    end = piece.rfind("\n")
    if end < MIN_CHARS or len(text) - start - end < 200:  # keep a continuation to generate
        return None
    return piece[:end + 1]


def code_prompt(text: str) -> str | None:
    """A function or class header with the lines that follow it (the body is what the model writes)."""
    matches = list(_DEF.finditer(text))
    for match in matches[len(matches) // 3:]:  # past the imports and constants at the top
        prompt = _cut_lines(text, match.start())
        if prompt is not None:
            return prompt
    return None


def json_prompt(text: str) -> str | None:
    return _cut_lines(text) if "\n" in text[:MAX_CHARS] else _cut_chars(text, ",")


def _cut_chars(text: str, separator: str) -> str | None:
    piece = text[:MAX_CHARS]
    end = piece.rfind(separator)
    if end < MIN_CHARS or len(text) - end < 200:
        return None
    return piece[:end + 1]


def prose_prompt(text: str) -> str | None:
    """Whole sentences from the first paragraph that has enough of them."""
    for paragraph_start in [0, *(m.end() for m in re.finditer(r"\n\s*\n", text))]:
        piece = text[paragraph_start:paragraph_start + MAX_CHARS]
        ends = [m.end() for m in _SENTENCE_END.finditer(piece)]
        ends = [e for e in ends if e >= MIN_CHARS]
        if ends and len(text) - paragraph_start - ends[-1] >= 200:
            return piece[:ends[-1]].rstrip() + " "
    return None


CUTTERS = {"json": json_prompt, "code": code_prompt, "prose": prose_prompt}


def extract(corpora: Path, per_scenario: int, count_tokens) -> dict[str, list[dict[str, str]]]:
    out: dict[str, list[dict[str, str]]] = {}
    for scenario, (domain, _, _) in SCENARIOS.items():
        docs = [json.loads(line) for line in (corpora / domain / "valid.jsonl").open(encoding="utf-8")]
        docs.sort(key=lambda d: _rank(d["id"]))
        chosen: list[dict[str, str]] = []
        groups: dict[str, int] = {}
        quota = max(2, per_scenario // max(1, len({_group(d) for d in docs})))
        for relaxed in (False, True):  # first spread over the sources, then fill up
            for doc in docs:
                if len(chosen) == per_scenario:
                    break
                taken = any(c["id"] == doc["id"] for c in chosen)
                if taken or (not relaxed and groups.get(_group(doc), 0) >= quota):
                    continue
                prompt = CUTTERS[scenario](doc["text"])
                if prompt is None or count_tokens(prompt) > MAX_PROMPT_TOKENS:
                    continue
                chosen.append({"id": doc["id"], "prompt": prompt})
                groups[_group(doc)] = groups.get(_group(doc), 0) + 1
        if len(chosen) < per_scenario:
            raise SystemExit(f"{scenario}: only {len(chosen)} usable held-out documents")
        out[scenario] = chosen
    return out


CHAT_PROMPTS_FILE = REPO_ROOT / "client" / "specdec_client" / "prompts" / "bench_chat.json"
# Held-out chat requests: written for the benchmark, unlike any request build/chat_requests.py makes for
# training (different wording, subjects and fields).
CHAT_REQUESTS = {
    "json": ["Produce a JSON object for a hotel booking: guest, nights, room_type, breakfast (a boolean).",
             "Output a JSON list of three programming languages, each with name, year_created and typing.",
             "I need JSON for a weather report with fields location, temperature_c, humidity and wind_kmh.",
             "Describe a smartphone as JSON with brand, model, storage_gb, price_usd and colors (a list).",
             "Create a JSON configuration for a web server: host, port, tls (an object) and routes (a list).",
             "Represent a school class as JSON: teacher, room, and a list of four students with name and age.",
             "Turn this into JSON: Maria, 34, nurse, lives in Porto, speaks Portuguese and English.",
             "Give a JSON object for a flight with number, origin, destination, departure time and seats left."],
    "code": ["Implement binary search in Python as a function that returns the index or -1.",
             "Write a Python function that counts the words in a string and returns a dictionary.",
             "Write a Python generator that yields the Fibonacci numbers below a limit.",
             "Write a Python function to flatten a nested list of integers.",
             "Write a Python function that validates an email address with a regular expression.",
             "Write a Python class for a stack with push, pop, peek and is_empty methods.",
             "Write a Python function that removes duplicate items from a list but keeps their order.",
             "Write a Python script that prints the ten most common lines of a text file."],
    "prose": ["Tell me about the history of tea in a few paragraphs.",
              "Write a short story about a lost dog finding its way home.",
              "Explain how a rainbow forms, for a curious ten-year-old.",
              "Write a letter thanking a neighbour for help after a storm.",
              "Describe what a day in the life of a lighthouse keeper might look like.",
              "What are the benefits of walking every day? Write a few paragraphs.",
              "Write a short essay about why people enjoy music.",
              "Describe a busy train station in the morning."],
}


def chat_document(tokenizer_dir: Path) -> dict:
    """bench.json's layout for the held-out chat requests, in the target's chat template."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    scenarios = {}
    for name, (_, task, max_tokens) in SCENARIOS.items():
        prompts = [{"id": f"chat-{name}/{i:02d}", "prompt": tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)}
            for i, text in enumerate(CHAT_REQUESTS[name])]
        scenarios[name] = {"task": task, "max_tokens": max_tokens, "prompts": prompts}
    return {"about": "Held-out chat requests (client/specdec_client/bench_prompts.py CHAT_REQUESTS, never trained "
                     "on) in the target's chat template. Made by `python -m specdec_client.bench_prompts --chat`.",
            "scenarios": scenarios}


def perf_analyzer_data(prompts: list[str], max_tokens: int, task: str) -> dict:
    """perf_analyzer --input-data: one entry per prompt, every input shaped [1] (batch 1 is added)."""
    return {"data": [{
        "text_input": {"content": [p], "shape": [1]},
        "max_tokens": {"content": [max_tokens], "shape": [1]},
        "stream": {"content": [True], "shape": [1]},
        "task": {"content": [task], "shape": [1]},
    } for p in prompts]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpora", type=Path, default=REPO_ROOT / "data" / "corpora")
    parser.add_argument("--per-scenario", type=int, default=PROMPTS_PER_SCENARIO)
    parser.add_argument("--tokenizer", type=Path, default=REPO_ROOT / "model_repository" / "target_model" / "1")
    parser.add_argument("--out", type=Path, default=PROMPTS_FILE)
    parser.add_argument("--perf-dir", type=Path, default=PERF_DIR)
    parser.add_argument("--chat", action="store_true", help=f"write the chat requests to {CHAT_PROMPTS_FILE.name}")
    args = parser.parse_args(argv)
    if args.chat:
        CHAT_PROMPTS_FILE.write_text(json.dumps(chat_document(args.tokenizer), indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {CHAT_PROMPTS_FILE}")
        return 0
    from specdec.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(args.tokenizer)
    prompts = extract(args.corpora, args.per_scenario, lambda text: len(tokenizer.encode(text)))
    manifest = json.loads((args.corpora / "manifest.json").read_text())
    document = {
        "about": "Held-out benchmark prompts: openings of documents of the validation split of build/corpora.py "
                 "(never trained on). Made by `python -m specdec_client.bench_prompts`.",
        "corpora_valid_sha256": {d: manifest["domains"][d]["valid"]["sha256"] for d, _, _ in SCENARIOS.values()},
        "scenarios": {name: {"task": task, "max_tokens": max_tokens, "prompts": prompts[name]}
                      for name, (_, task, max_tokens) in SCENARIOS.items()},
    }
    args.out.write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}")
    args.perf_dir.mkdir(parents=True, exist_ok=True)
    for name, (_, task, max_tokens) in SCENARIOS.items():
        texts = [p["prompt"] for p in prompts[name]]
        path = args.perf_dir / f"{name}.json"
        path.write_text(json.dumps(perf_analyzer_data(texts, max_tokens, task), indent=1, ensure_ascii=False) + "\n")
        gpath = args.perf_dir / f"genai_perf_{name}.jsonl"
        gpath.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts))
        print(f"wrote {path} and {gpath}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
