"""build/chat_requests.py --exclude: the requests of another set are left out, the others keep their ids;
build/open_requests.py: many distinct open-ended asks, none about a held-out benchmark request's subject."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

BUILD = Path(__file__).resolve().parents[2] / "build"
sys.path.insert(0, str(BUILD))

import chat_requests  # noqa: E402
import open_requests  # noqa: E402


def test_exclude_drops_the_requests_of_another_set(tmp_path, monkeypatch) -> None:
    made = [{"id": "req-000000", "domain": "code", "kind": "k", "messages": [{"role": "user", "content": "a"}]},
            {"id": "req-000001", "domain": "prose", "kind": "raw", "prompt": "Once"},
            {"id": "req-000002", "domain": "json", "kind": "k", "messages": [{"role": "user", "content": "b"}]}]
    monkeypatch.setattr(chat_requests, "build", lambda corpora, counts, seed: [dict(r) for r in made])
    other = tmp_path / "other.jsonl"  # another seed's set: the same asks under other ids
    other.write_text("".join(json.dumps({**r, "id": f"req-9{i}"}) + "\n" for i, r in enumerate(made[:2])))
    out = tmp_path / "requests.jsonl"
    chat_requests.main(["--out", str(out), "--exclude", str(other)])
    assert [json.loads(line) for line in out.read_text().splitlines()] == [made[2]]
    chat_requests.main(["--out", str(out)])
    assert len(out.read_text().splitlines()) == 3


def test_open_requests_never_ask_about_a_benchmark_subject(tmp_path, monkeypatch) -> None:
    """Every held-out benchmark request names one of BENCHMARK_SUBJECTS; no open request that does is kept."""
    from specdec_client.bench_prompts import CHAT_REQUESTS

    benchmark = [text for texts in CHAT_REQUESTS.values() for text in texts]
    assert all(open_requests.names_benchmark_subject(text) for text in benchmark)
    assert not open_requests.names_benchmark_subject("Write a Python class for a teacher's timetable.")  # words
    monkeypatch.setattr(chat_requests, "read_jsonl", lambda path: [])  # open asks need no corpus (none in CI)
    out = tmp_path / "requests.jsonl"
    chat_requests.main(["--out", str(out), "--counts", "code=0,json=0,prose=0,raw=0,open=3000,open_code=1000",
                        "--seed", "5"])
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    made = chat_requests.build(tmp_path, {"open": 3000, "open_code": 1000}, seed=5)
    dropped = [r for r in made if open_requests.names_benchmark_subject(r["messages"][0]["content"])]
    assert dropped and len(kept) == len(made) - len(dropped)  # "a binary search tree" names "binary search"
    assert not [r for r in kept if open_requests.names_benchmark_subject(r["messages"][0]["content"])]
    assert not set(benchmark) & {r["messages"][0]["content"] for r in kept}


def test_open_requests_are_many_distinct_asks_in_every_domain() -> None:
    made = list(open_requests.open_requests(random.Random(5), 3000))
    assert made == list(open_requests.open_requests(random.Random(5), 3000))  # deterministic for a seed
    by_domain: dict[str, set[str]] = {}
    for r in made:
        assert r["kind"] == "open" and r["messages"][0]["role"] == "user"
        by_domain.setdefault(r["domain"], set()).add(r["messages"][0]["content"])
    assert sorted(by_domain) == ["code", "json", "prose"]
    assert all(len(asks) > 600 for asks in by_domain.values()), {d: len(a) for d, a in by_domain.items()}


def test_open_code_requests_add_python_asks_and_leave_earlier_sets_alone(tmp_path, monkeypatch) -> None:
    """Stage 7's kind: many distinct Python asks, none also made by the open kind; it is built after the other
    kinds, so they make the same asks for a seed with it as without it."""
    monkeypatch.setattr(chat_requests, "read_jsonl", lambda path: [])

    def open_asks(counts: dict[str, int]) -> list[str]:
        made = chat_requests.build(tmp_path, counts, seed=7)
        return sorted(r["messages"][0]["content"] for r in made if r["kind"] == "open")

    assert open_asks({"open": 600}) == open_asks({"open": 600, "open_code": 300})
    made = list(open_requests.open_code_requests(random.Random(7), 2000))
    asks = {r["messages"][0]["content"] for r in made}
    assert all(r["domain"] == "code" and r["kind"] == "open_code" for r in made)
    assert len(asks) > 1000
    old = {r["messages"][0]["content"] for r in open_requests.open_requests(random.Random(7), 6000)
           if r["domain"] == "code"}
    assert not asks & old
