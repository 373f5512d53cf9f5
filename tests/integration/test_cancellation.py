"""Cancellation and disconnects: a cancelled stream, a client that dies, an SSE client that hangs up, or a
deadline stops the generation early and frees its KV slots, directly on speculative_decoding and through the
ensemble (where Triton 2.51 does not propagate cancellation: postprocessing marks the generation abandoned)."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from specdec_client.api import grpc_inputs
from specdec_client.soak import Soak, kv_slots_in_use
from transformers import AutoTokenizer

pytestmark = pytest.mark.integration
LONG = 900  # tokens a generation would run to if nothing stopped it (min_length keeps it from ending early)
LONG_PARAMS = {"text_input": "def fibonacci(n):", "max_tokens": LONG, "min_length": LONG, "stream": True,
               "num_draft_tokens": 0}
STOPPED = re.compile(r"generation (\d+) stopped \((\w+)\) after (\d+) tokens")


def stopped_lines(server) -> list[tuple[int, str, int]]:
    return [(int(g), reason, int(n)) for g, reason, n in STOPPED.findall(server.log_file.read_text())]


def wait_for_stop(server, before: int, reason: str, timeout_s: float = 15.0) -> tuple[int, str, int]:
    """The next generation stop logged after the first `before` ones; then every KV slot must be free."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        lines = stopped_lines(server)[before:]
        if lines:
            assert lines[0][1] == reason, lines
            while kv_slots_in_use(server.metrics_url) != 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert kv_slots_in_use(server.metrics_url) == 0
            return lines[0]
        time.sleep(0.1)
    raise AssertionError(f"no generation stopped ({reason}) within {timeout_s} s")


def direct_inputs(server, params: dict) -> list[grpcclient.InferInput]:
    """speculative_decoding's own inputs: token ids instead of text."""
    tokenizer = AutoTokenizer.from_pretrained(server.model_repository / "target_model" / "1")
    ids = np.array([tokenizer(params["text_input"]).input_ids], dtype=np.int32)
    tensors = [grpcclient.InferInput("input_ids", list(ids.shape), "INT32"),
               grpcclient.InferInput("input_lengths", [1, 1], "INT32")]
    tensors[0].set_data_from_numpy(ids)
    tensors[1].set_data_from_numpy(np.array([[ids.shape[1]]], dtype=np.int32))
    return tensors + grpc_inputs({k: v for k, v in params.items() if k != "text_input"})


def stream_then_cancel(server, model: str, inputs: list, chunks: int = 2) -> int:
    """Read `chunks` responses of a stream, then cancel it; returns the generation id seen (0 if none)."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    generation_id = 0
    try:
        client.async_stream_infer(model, inputs)
        for _ in range(chunks):
            result, error = answers.get(timeout=60)
            assert error is None, error
            ids = result.as_numpy("generation_id")
            generation_id = int(ids.reshape(-1)[0]) if ids is not None else 0
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()
    return generation_id


def test_cancelled_stream_to_speculative_decoding_stops_and_frees_its_slots(server):
    before = len(stopped_lines(server))
    generation_id = stream_then_cancel(server, "speculative_decoding", direct_inputs(server, LONG_PARAMS))
    stopped_id, _, tokens = wait_for_stop(server, before, "cancelled")
    assert stopped_id == generation_id and tokens < LONG // 4


def test_cancelled_stream_through_the_ensemble_stops_and_frees_its_slots(server):
    before = len(stopped_lines(server))
    stream_then_cancel(server, "ensemble", grpc_inputs(LONG_PARAMS))
    _, _, tokens = wait_for_stop(server, before, "abandoned")
    assert tokens < LONG // 4


DYING_CLIENT = textwrap.dedent("""
    import os, queue, sys
    import tritonclient.grpc as grpcclient
    from specdec_client.api import grpc_inputs
    client = grpcclient.InferenceServerClient(sys.argv[1])
    answers = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put(error))
    client.async_stream_infer("ensemble", grpc_inputs({params!r}))
    for _ in range(2):
        assert answers.get(timeout=60) is None
    os._exit(0)  # no goodbye: the connection just drops
""")


def test_a_client_that_dies_mid_stream_frees_its_slots(server):
    before = len(stopped_lines(server))
    script = DYING_CLIENT.format(params=LONG_PARAMS)
    subprocess.run([sys.executable, "-c", script, server.grpc_url], check=True, timeout=120)
    _, _, tokens = wait_for_stop(server, before, "abandoned")
    assert tokens < LONG // 4


def test_an_sse_client_that_hangs_up_frees_its_slots(server):
    before = len(stopped_lines(server))
    with requests.post(f"http://{server.http_url}/v2/models/ensemble/generate_stream", json=LONG_PARAMS,
                       stream=True, timeout=60) as resp:
        events = 0
        for line in resp.iter_lines():
            events += line.startswith(b"data: ")
            if events == 2:
                break
    _, _, tokens = wait_for_stop(server, before, "abandoned")
    assert tokens < LONG // 4


def test_request_timeout_is_a_generation_deadline(server):
    """A non-streaming request through the ensemble has no chunk to notice a departed client: its deadline
    (Triton's request `timeout`, or the server's max_generation_s) bounds it, with a clear error."""
    before = len(stopped_lines(server))
    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("ensemble", grpc_inputs({**LONG_PARAMS, "stream": False}), timeout=400_000)
        result, error = answers.get(timeout=60)
    finally:
        client.stop_stream()
        client.close()
    assert result is None and "deadline of 0.4 s" in str(error)
    _, _, tokens = wait_for_stop(server, before, "deadline")
    assert tokens < LONG


def test_many_requests_with_a_third_cancelled_leave_no_slot_held(server):
    """The short version of `make soak-cancel` (1000 requests, 30% cancelled mid-stream)."""
    report = Soak(server.grpc_url, server.metrics_url, server.process.pid, concurrency=8, duration_s=120,
                  max_requests=40, cancel_fraction=0.3, max_tokens=(48, 96), sample_s=5, warmup_s=0).run()
    print(report.text())
    assert report.error_count == 0, report.errors
    assert report.cancelled >= 5 and report.completed + report.cancelled == report.requests == 40
    assert report.final_kv_slots_in_use == 0
