"""Chat requests in the three domains, built offline from the training split of the project's corpora.

The default target is an instruct model, so its draft must learn what the target writes when it answers a
chat request (and, for raw-text clients, what it writes when it continues a document). This script turns
the training documents of ``build/corpora.py`` (never the validation split the benchmark prompts come
from) into requests; ``build/target_answers.py`` then has the target answer them.

- ``code``: write a function from a standard-library signature and the first sentence of its docstring;
  complete, explain, or add a docstring to a standard-library function; write a class.
- ``json``: produce a JSON object from a key/value description; reformat, extract from or extend a JSON
  document; a JSON array of a few records.
- ``prose``: a paragraph on a headword of The Devil's Dictionary; explain a saying from fortunes;
  summarise or continue a passage; a short essay or a letter.
- ``raw``: the opening of a training document of any domain, as a plain continuation prompt.
- ``open``: open-ended asks of all three domains composed from slot lists (``build/open_requests.py``; none
  built by default: ``--counts open=3000`` makes the stage-6 set); ``open_code``: more Python asks from other
  slot lists (stage 7).

Output: one JSON object a line, ``{"id", "domain", "kind", "messages" | "prompt"}``, deterministic for a
seed. ``--exclude FILE`` drops the requests that are also in FILE (a set built with another seed, e.g. one a
head was already trained on: about 13% of two seeds' requests coincide); the others keep their ids.
Usage: ``python build/chat_requests.py --corpora data/corpora --out data/chat/requests.jsonl``
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpora import read_jsonl  # noqa: E402
from open_requests import names_benchmark_subject, open_code_requests, open_requests  # noqa: E402

Request = dict[str, object]
MAX_SNIPPET_LINES = 30
MAX_PASSAGE_CHARS = 900

PROSE_TOPICS = ("the sea", "friendship", "a rainy day in a city", "the history of bread", "learning to swim",
                "why people keep diaries", "the night sky", "a small mountain village", "libraries",
                "the first day of school", "trains", "gardening in spring", "the value of patience",
                "an old lighthouse", "the invention of the printing press", "winter mornings",
                "a market at dawn", "honesty", "rivers", "the life of bees")
PROSE_FORMS = ("Write a short paragraph about {t}.", "Write a short essay on {t}.",
               "Describe {t} in a few sentences.", "Write a short story about {t}.",
               "Write a letter to a friend about {t}.", "Explain to a child what is special about {t}.")
JSON_THINGS = {
    "book": ("title", "author", "year", "genre"), "user": ("id", "name", "email", "active"),
    "product": ("sku", "name", "price", "in_stock"), "city": ("name", "country", "population"),
    "movie": ("title", "director", "year", "rating"), "order": ("order_id", "customer", "total", "status"),
    "employee": ("id", "name", "department", "salary"), "event": ("name", "date", "location", "attendees"),
    "car": ("make", "model", "year", "color"), "recipe": ("name", "servings", "ingredients", "minutes"),
}


def _functions(source: str) -> Iterator[tuple[ast.FunctionDef, str]]:
    """Top-level and method functions of a module with a docstring, and their source text."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) and not node.name.startswith("__"):
            end = node.end_lineno or node.lineno
            if end - node.lineno + 1 <= MAX_SNIPPET_LINES:
                yield node, "\n".join(lines[node.lineno - 1:end])


def _first_sentence(doc: str) -> str:
    text = " ".join(doc.split())
    match = re.match(r"(.+?[.!?])(\s|$)", text)
    return (match.group(1) if match else text)[:200]


def _dedent(snippet: str) -> str:
    indent = min((len(line) - len(line.lstrip()) for line in snippet.splitlines() if line.strip()), default=0)
    return "\n".join(line[indent:] for line in snippet.splitlines())


def code_requests(docs: list[dict], rng: random.Random, n: int) -> Iterator[Request]:
    funcs = [f for d in docs for f in _functions(d["text"])]
    rng.shuffle(funcs)
    for i in range(n):
        node, snippet = funcs[i % len(funcs)]
        snippet = _dedent(snippet)
        sig = snippet.split("\n", 1)[0].removeprefix("def ").rstrip(":")
        purpose = _first_sentence(ast.get_docstring(node) or "")
        body_lines = snippet.splitlines()
        kind = rng.choice(("write", "write", "complete", "explain", "docstring", "class"))
        if kind == "write":
            text = f"Write a Python function `{sig}`. {purpose}"
        elif kind == "complete":
            head = "\n".join(body_lines[:max(2, len(body_lines) // 3)])
            text = f"Complete this Python function:\n```python\n{head}\n```"
        elif kind == "explain":
            text = f"Explain what this Python code does:\n```python\n{snippet}\n```"
        elif kind == "docstring":
            text = f"Rewrite this function with type hints and a clear docstring:\n```python\n{snippet}\n```"
        else:
            thing = rng.choice(sorted(JSON_THINGS))
            fields = ", ".join(JSON_THINGS[thing])
            text = f"Write a Python class `{thing.title()}` with the attributes {fields} and a `__repr__` method."
        yield {"domain": "code", "kind": kind, "messages": [{"role": "user", "content": text}]}


def json_requests(docs: list[dict], rng: random.Random, n: int) -> Iterator[Request]:
    for _ in range(n):
        kind = rng.choice(("describe", "object", "reformat", "extract", "array"))
        if kind in ("describe", "object", "array"):
            thing = rng.choice(sorted(JSON_THINGS))
            keys = JSON_THINGS[thing]
            if kind == "describe":
                text = f"Give me a JSON object describing a {thing} with the fields {', '.join(keys)}."
            elif kind == "object":
                text = f"Return only JSON: an object for a {thing}, keys " + ", ".join(f'"{k}"' for k in keys) + "."
            else:
                text = f"Write a JSON array of {rng.randint(2, 4)} {thing}s, each with {', '.join(keys)}."
        else:
            raw = rng.choice(docs)["text"]
            try:
                value = json.loads(raw)
            except ValueError:
                continue
            compact = json.dumps(value, ensure_ascii=False)
            if len(compact) > MAX_PASSAGE_CHARS:
                compact = json.dumps(value if not isinstance(value, list) else value[:2], ensure_ascii=False)
                if len(compact) > MAX_PASSAGE_CHARS:
                    continue
            if kind == "reformat":
                text = f"Reformat this JSON with an indentation of 2 spaces:\n{compact}"
            else:
                keys = sorted(value) if isinstance(value, dict) else []
                field = rng.choice(keys) if keys else "first item"
                text = f"From this JSON, return a JSON object with only the \"{field}\" field:\n{compact}"
        yield {"domain": "json", "kind": kind, "messages": [{"role": "user", "content": text}]}


def _passage(docs: list[dict], rng: random.Random) -> str:
    text = rng.choice(docs)["text"]
    start = rng.randrange(0, max(1, len(text) - MAX_PASSAGE_CHARS))
    chunk = text[start:start + MAX_PASSAGE_CHARS]
    return " ".join(chunk.split(" ")[1:-1]) if start else " ".join(chunk.split(" ")[:-1])


def prose_requests(docs: list[dict], rng: random.Random, n: int) -> Iterator[Request]:
    devil = [d for d in docs if d["source"] == "devil"]
    fortunes = [d for d in docs if d["source"] == "fortunes"]
    for _ in range(n):
        kind = rng.choice(("topic", "topic", "define", "saying", "summarise", "continue"))
        if kind == "define" and devil:
            entry = rng.choice(rng.choice(devil)["text"].split("\n\n")).strip()
            word = entry.split(",", 1)[0].split("\n", 1)[0].strip().lower()
            text = f"Write a short paragraph about the word \"{word}\" and what it means."
        elif kind == "saying" and fortunes:
            saying = rng.choice([s for s in rng.choice(fortunes)["text"].split("\n%\n") if s.strip()] or ["Be kind."])
            text = f"Explain the meaning of this saying in a few sentences:\n{saying.strip()[:400]}"
        elif kind == "summarise":
            text = f"Summarise this passage in a few sentences:\n{_passage(docs, rng)}"
        elif kind == "continue":
            text = f"Continue this text:\n{_passage(docs, rng)[:400]}"
        else:
            text = rng.choice(PROSE_FORMS).format(t=rng.choice(PROSE_TOPICS))
        yield {"domain": "prose", "kind": kind, "messages": [{"role": "user", "content": text}]}


def raw_requests(corpora: dict[str, list[dict]], rng: random.Random, n: int) -> Iterator[Request]:
    """Openings of training documents, cut after 16-400 characters at a word boundary."""
    domains = sorted(corpora)
    for _ in range(n):
        domain = rng.choice(domains)
        text = rng.choice(corpora[domain])["text"]
        cut = text.rfind(" ", 0, rng.randint(16, 400))
        yield {"domain": domain, "kind": "raw", "prompt": text[:cut if cut > 8 else 64]}


OPEN_KINDS = ("open", "open_code")  # composed asks: those naming a benchmark subject are dropped

MAKERS: dict[str, Callable[[list[dict], random.Random, int], Iterator[Request]]] = {
    "code": code_requests, "json": json_requests, "prose": prose_requests}


def build(corpora: Path, counts: dict[str, int], seed: int) -> list[Request]:
    """All requests, shuffled, with ids; ``counts`` maps code/json/prose/raw/open/open_code to how many of each."""
    rng = random.Random(seed)
    docs = {dom: read_jsonl(corpora / dom / "train.jsonl") for dom in MAKERS}
    made: list[Request] = []
    for dom, maker in MAKERS.items():
        made.extend(maker(docs[dom], rng, counts.get(dom, 0)))
    made.extend(raw_requests(docs, rng, counts.get("raw", 0)))
    made.extend(open_requests(rng, counts.get("open", 0)))
    made.extend(open_code_requests(rng, counts.get("open_code", 0)))  # after the others: earlier sets keep their ids
    unique = list({json.dumps(req, sort_keys=True): req for req in made}.values())  # template collisions
    rng.shuffle(unique)
    return [{"id": f"req-{i:06d}", **req} for i, req in enumerate(unique)]


def request_text(request: Request) -> str:
    """What a request asks, as a key: its messages or its raw prompt."""
    return json.dumps(request.get("messages") or request.get("prompt"), sort_keys=True)


def main(argv: list[str] | None = None) -> None:
    """Command line entry point."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpora", type=Path, default=Path("data/corpora"))
    ap.add_argument("--out", type=Path, default=Path("data/chat/requests.jsonl"))
    ap.add_argument("--counts", default="code=3000,json=3000,prose=3000,raw=3000")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--exclude", type=Path, action="append", default=[],
                    help="requests JSONL whose requests are left out (repeatable)")
    args = ap.parse_args(argv)
    counts = {k: int(v) for k, v in (part.split("=") for part in args.counts.split(","))}
    requests = build(args.corpora, counts, args.seed)
    seen = {request_text(req) for path in args.exclude for req in read_jsonl(path)}
    # Filtered after the ids are given (as --exclude), so a set made before a filter existed keeps its ids.
    requests = [req for req in requests if request_text(req) not in seen
                and not (req["kind"] in OPEN_KINDS and names_benchmark_subject(request_text(req)))]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for req in requests:
            f.write(json.dumps(req, ensure_ascii=False) + "\n")
    print(f"{len(requests)} requests -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
