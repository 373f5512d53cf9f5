"""Replay the hostile-input corpus (tests/data/hostile_requests.jsonl) against a server on loopback.

Each request is sent as its entry says (HTTP JSON or raw bytes to /generate, a gRPC stream, or a unary gRPC
call with sequence controls), and what came back is checked against the entry's `expect`. After every entry a
good request must succeed. `python -m specdec_client.hostile --http 127.0.0.1:8000 --grpc 127.0.0.1:8001`
prints one line per entry and a summary of the answers by kind.
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import queue
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from specdec_client.api import generate_grpc
from specdec_client.soak import require_loopback

CORPUS = Path(__file__).resolve().parents[2] / "tests" / "data" / "hostile_requests.jsonl"
ANSWER_TIMEOUT_S = 60.0
GRPC_CODE_FOR_STATUS = {400: "INVALID_ARGUMENT", 500: "INTERNAL", 503: "UNAVAILABLE"}
NUMPY_TYPES = {"BOOL": np.bool_, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "UINT32": np.uint32,
               "UINT64": np.uint64, "FP32": np.float32, "FP64": np.float64}
GOOD_REQUEST = {"text_input": "def add(a, b):", "max_tokens": 1}


@dataclass
class Answer:
    """What the server answered: an HTTP status or gRPC code (None when unknown), and the error message."""

    status: int | str | None
    error: str | None
    seconds: float

    @property
    def ok(self) -> bool:
        return self.error is None


def load_corpus(path: Path = CORPUS) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def expand(value: Any) -> Any:
    """Replace {"$repeat": [unit, count]} and {"$concat": [[unit, count], ...]} by the strings they stand for."""
    if isinstance(value, dict):
        if set(value) == {"$repeat"}:
            unit, count = value["$repeat"]
            return unit * count
        if set(value) == {"$concat"}:
            return "".join(unit * count for unit, count in value["$concat"])
        return {key: expand(item) for key, item in value.items()}
    if isinstance(value, list):
        return [expand(item) for item in value]
    return value


def grpc_input(spec: dict) -> grpcclient.InferInput:
    shape = spec["shape"]
    if spec["datatype"] == "BYTES":
        if "data_b64" in spec:
            values = [base64.b64decode(v) for v in spec["data_b64"]]
        else:
            values = [expand(v).encode() for v in spec["data"]]
        array = np.array(values, dtype=np.object_).reshape(shape)
    else:
        array = np.array(spec["data"], dtype=NUMPY_TYPES[spec["datatype"]]).reshape(shape)
    tensor = grpcclient.InferInput(spec["name"], list(shape), spec["datatype"])
    tensor.set_data_from_numpy(array)
    return tensor


def send_http(http_url: str, entry: dict, session: requests.Session) -> Answer:
    url = f"http://{http_url}/v2/models/{entry['model']}/generate"
    if entry["transport"] == "http":
        data: bytes = json.dumps(expand(entry["body"]), allow_nan=True).encode()
    elif "raw_b64" in entry:
        data = base64.b64decode(entry["raw_b64"])
    else:
        data = expand(entry["raw"]).encode("utf-8", errors="surrogatepass")
    started = time.monotonic()
    resp = session.post(url, data=data, headers={"Content-Type": entry.get("content_type", "application/json")},
                        timeout=ANSWER_TIMEOUT_S)
    try:
        error = resp.json().get("error")
    except ValueError:
        error = None if resp.status_code == 200 else resp.text
    return Answer(resp.status_code, error, time.monotonic() - started)


def send_grpc_stream(grpc_url: str, entry: dict) -> Answer:
    client = grpcclient.InferenceServerClient(grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    started = time.monotonic()
    try:
        client.async_stream_infer(entry["model"], [grpc_input(spec) for spec in entry["inputs"]],
                                  enable_empty_final_response=True)
        while True:
            result, error = answers.get(timeout=ANSWER_TIMEOUT_S)
            if error is not None:
                return Answer(error.status(), error.message(), time.monotonic() - started)
            final = result.get_response().parameters.get("triton_final_response")
            if final is None or final.bool_param:
                return Answer(None, None, time.monotonic() - started)
    finally:
        client.stop_stream()
        client.close()


def send_grpc_infer(grpc_url: str, entry: dict) -> Answer:
    client = grpcclient.InferenceServerClient(grpc_url)
    sequence = entry.get("sequence") or {}
    started = time.monotonic()
    try:
        client.infer(entry["model"], [grpc_input(spec) for spec in entry["inputs"]],
                     outputs=[grpcclient.InferRequestedOutput("token_ids")], client_timeout=ANSWER_TIMEOUT_S,
                     sequence_id=sequence.get("id", 0), sequence_start=sequence.get("start", False),
                     sequence_end=sequence.get("end", False))
        return Answer(None, None, time.monotonic() - started)
    except InferenceServerException as exc:
        return Answer((exc.status() or "").replace("StatusCode.", ""), exc.message(), time.monotonic() - started)
    finally:
        client.close()


def send(entry: dict, http_url: str, grpc_url: str, session: requests.Session) -> Answer:
    if entry["transport"] in ("http", "http_raw"):
        return send_http(http_url, entry, session)
    if entry["transport"] == "grpc":
        return send_grpc_stream(grpc_url, entry)
    return send_grpc_infer(grpc_url, entry)


def mismatch(entry: dict, answer: Answer) -> str | None:
    """Why the answer does not meet the entry's expectation, or None when it does."""
    expect = entry["expect"]
    outcome = expect["outcome"]
    if outcome == "ok":
        if not answer.ok or answer.status not in (None, 200):
            return f"expected success ({expect['policy']}), got {answer.status}: {answer.error}"
        return None
    if answer.ok:
        return f"expected a {outcome} error, got success"
    message = answer.error or ""
    field = expect.get("field")
    if field and field not in message:
        return f"error does not name {field!r}: {message[:300]}"
    if expect.get("message") and expect["message"] not in message:
        return f"error lacks {expect['message']!r}: {message[:300]}"
    wanted = expect["http_status"]
    if entry["transport"] in ("http", "http_raw"):
        if answer.status != wanted:
            return f"expected HTTP {wanted}, got {answer.status}: {message[:300]}"
    elif entry["transport"] == "grpc_infer" and answer.status != GRPC_CODE_FOR_STATUS[wanted]:
        return f"expected gRPC {GRPC_CODE_FOR_STATUS[wanted]}, got {answer.status}: {message[:300]}"
    return None


def good_request_works(entry: dict, http_url: str, grpc_url: str, session: requests.Session) -> str | None:
    """A good request over the same transport must succeed after every hostile one."""
    try:
        if entry["transport"].startswith("http"):
            resp = session.post(f"http://{http_url}/v2/models/ensemble/generate", json=GOOD_REQUEST,
                                timeout=ANSWER_TIMEOUT_S)
            if resp.status_code != 200 or "error" in resp.json():
                return f"good HTTP request failed: {resp.status_code} {resp.text[:300]}"
        elif generate_grpc(grpc_url, GOOD_REQUEST, timeout_s=ANSWER_TIMEOUT_S).num_output_tokens < 1:
            return "good gRPC request returned no token"
    except Exception as exc:
        return f"good request failed: {type(exc).__name__}: {exc}"
    return None


def summarize(results: list[tuple[dict, Answer]]) -> str:
    """Answers by kind of input and by what came back (HTTP status / gRPC code / stream error)."""
    table: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for entry, answer in results:
        if answer.ok:
            label = "accepted"
        elif entry["transport"] == "grpc":
            label = "gRPC stream error"
        else:
            label = f"{'HTTP' if entry['transport'].startswith('http') else 'gRPC'} {answer.status}"
        table[entry["kind"]][label] += 1
    lines = [f"{len(results)} requests"]
    for kind in sorted(table):
        lines.append(f"  {kind:12s} " + ", ".join(f"{label}: {n}" for label, n in sorted(table[kind].items())))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", default="127.0.0.1:8000", help="HTTP host:port (loopback only)")
    parser.add_argument("--grpc", default="127.0.0.1:8001", help="gRPC host:port (loopback only)")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    args = parser.parse_args(argv)
    require_loopback(args.http)
    require_loopback(args.grpc)
    results, failures = [], 0
    with requests.Session() as session:
        for entry in load_corpus(args.corpus):
            answer = send(entry, args.http, args.grpc, session)
            problem = mismatch(entry, answer) or good_request_works(entry, args.http, args.grpc, session)
            failures += problem is not None
            results.append((entry, answer))
            shown = (answer.error or "ok").replace("\n", " ")[:110]
            print(f"{'FAIL' if problem else 'ok  '} {entry['id'][:60]:60s} {answer.status!s:>16} {shown}"
                  + (f"\n     {problem}" if problem else ""))
    print(summarize(results))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
