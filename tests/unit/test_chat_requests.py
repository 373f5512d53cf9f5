"""build/chat_requests.py --exclude: the requests of another set are left out, the others keep their ids."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BUILD = Path(__file__).resolve().parents[2] / "build"
sys.path.insert(0, str(BUILD))

import chat_requests  # noqa: E402


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
