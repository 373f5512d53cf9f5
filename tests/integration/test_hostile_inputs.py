"""The hostile-input corpus (tests/data/hostile_requests.jsonl) against the real server: every request gets a
clear error or its documented policy, none crashes a model process, hangs or holds a KV slot, and a good request
succeeds after each one."""

from __future__ import annotations

import collections
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from specdec_client.hostile import good_request_works, load_corpus, mismatch, send, summarize
from specdec_client.server import session_processes
from specdec_client.soak import kv_slots_in_use

pytestmark = pytest.mark.integration
REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATOR = REPO_ROOT / "tests" / "reliability" / "make_hostile_corpus.py"


def test_corpus_is_generated_and_fresh():
    result = subprocess.run([sys.executable, str(GENERATOR), "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    corpus = load_corpus()
    assert len(corpus) >= 200
    kinds = collections.Counter(entry["kind"] for entry in corpus)
    for kind in ("type", "shape", "missing", "empty", "size", "context", "range", "choice", "encoding", "malformed",
                 "unsupported"):
        assert kinds[kind] > 0, kind
    transports = collections.Counter(entry["transport"] for entry in corpus)
    assert set(transports) == {"http", "http_raw", "grpc", "grpc_infer"}


def test_every_hostile_request_is_answered_and_the_server_keeps_serving(server):
    processes_before = set(session_processes(server.process.pid))
    failures, results = [], []
    with requests.Session() as session:
        for entry in load_corpus():
            answer = send(entry, server.http_url, server.grpc_url, session)
            results.append((entry, answer))
            problem = mismatch(entry, answer) or good_request_works(entry, server.http_url, server.grpc_url, session)
            if problem:
                failures.append(f"{entry['id']}: {problem}")
    print(summarize(results))
    assert not failures, "\n".join(failures)
    # Nothing crashed or restarted (the same server and model processes), and no request holds a KV slot.
    assert server.process.poll() is None
    assert set(session_processes(server.process.pid)) == processes_before
    deadline = time.monotonic() + 10
    while kv_slots_in_use(server.metrics_url) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert kv_slots_in_use(server.metrics_url) == 0
