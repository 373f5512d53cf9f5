"""Backpressure and faults on a second server: the committed models in a temporary repository rendered from
cpu.yaml with 2 KV slots and short queues, model control explicit (for unloading), and decoders whose forward
pass can be made to fail through a file next to their model.py.

Order matters: the last test kills a model process and stops the server itself.

HTTP /generate answers every error a model returns with 400 on tritonserver 2.51, whatever its kind (its front end
reads the error code after freeing the error), so these tests tell kinds apart by the message: "server busy" for
backpressure (UNAVAILABLE), "internal error" for a failing model (INTERNAL).
"""

from __future__ import annotations

import concurrent.futures
import os
import queue
import signal
import time
from pathlib import Path

import pytest
import requests
import tritonclient.grpc as grpcclient
from repositories import build_repository as build_test_repository
from repositories import cpu_deployment
from specdec_client import health
from specdec_client.api import GenerationError, generate_grpc, grpc_inputs
from specdec_client.server import ADMIN_KEY_HEADER, SHM_DIR, SHM_PREFIX, TritonServer, free_port, session_processes
from specdec_client.soak import kv_slots_in_use

pytestmark = pytest.mark.integration
MODEL_ERROR_HTTP_STATUS = 400
REPO_ROOT = Path(__file__).resolve().parents[2]
SLOTS, QUEUED, QUEUE_TIMEOUT_S = 2, 2, 3
FAULTY_DECODER = '''"""A decoder whose forward fails ("error") or kills its process ("crash") as ./fault says."""

import os
from pathlib import Path

from specdec_triton.decoder import DecoderModel

FAULT = Path(__file__).with_name("fault")


class TritonPythonModel(DecoderModel):
    def initialize(self, args: dict) -> None:
        super().initialize(args)
        forward = self.engine.runtime.forward_outputs  # what the engines call

        def guarded(items):
            mode = FAULT.read_text().strip() if FAULT.exists() else ""
            if mode == "crash":
                os._exit(3)
            if mode == "error":
                raise RuntimeError("injected fault: the forward pass failed")
            return forward(items)

        self.engine.runtime.forward_outputs = guarded
'''


def build_repository(root: Path) -> Path:
    """The test pair's models (files symlinked), configs rendered for SLOTS slots and short queues, and the
    decoders' model.py replaced by the faulty one."""
    deployment = cpu_deployment()
    deployment["kv_cache"]["num_slots"] = SLOTS
    deployment["admission"].update(max_queued_generations=QUEUED, queue_timeout_s=QUEUE_TIMEOUT_S)
    build_test_repository(root, deployment)
    for name in ("target_model", "draft_model"):
        model_py = root / name / "1" / "model.py"
        model_py.unlink()
        model_py.write_text(FAULTY_DECODER)
    return root


@pytest.fixture(scope="module")
def fault_server(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fault_repo")
    server = TritonServer(model_repository=build_repository(root / "repo"), http_port=free_port(),
                          grpc_port=free_port(), metrics_port=free_port(), log_file=root / "server.log",
                          model_control_mode="explicit")
    for attempt in (1, 2):  # under heavy CPU load the Python backend can die at start-up (boost lock_exception)
        try:
            server.start(timeout_s=240)
            break
        except RuntimeError:
            print(server.log_file.read_text()[-3000:] if server.log_file.exists() else "no server log")
            if attempt == 2:
                raise
    yield server
    server.stop()


def set_fault(server: TritonServer, model: str, mode: str) -> None:
    (server.model_repository / model / "1" / "fault").write_text(mode)


def http_generate(server: TritonServer, **params) -> requests.Response:
    return requests.post(f"http://{server.http_url}/v2/models/ensemble/generate", json=params, timeout=120)


def wait_slots_free(server: TritonServer, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while kv_slots_in_use(server.metrics_url) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert kv_slots_in_use(server.metrics_url) == 0


class LongStream:
    """A streaming generation that holds a KV slot until closed (cancelled)."""

    def __init__(self, server: TritonServer) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.answers: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.answers.put((result, error)))
        self.client.async_stream_infer("ensemble", grpc_inputs(
            {"text_input": "In the beginning", "max_tokens": 900, "min_length": 900, "stream": True,
             "num_draft_tokens": 0}))
        result, error = self.answers.get(timeout=60)
        assert error is None, error

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def test_queue_policies_are_served(fault_server):
    for model in ("preprocessing", "speculative_decoding"):
        config = requests.get(f"http://{fault_server.http_url}/v2/models/{model}/config", timeout=10).json()
        policy = config["dynamic_batching"]["default_queue_policy"]
        assert int(policy["max_queue_size"]) > 0 and int(policy["default_timeout_microseconds"]) > 0
        assert policy["timeout_action"] == "REJECT"
    parameters = requests.get(f"http://{fault_server.http_url}/v2/models/speculative_decoding/config",
                              timeout=10).json()["parameters"]
    assert int(parameters["max_concurrent_sequences"]["string_value"]) == SLOTS
    assert int(parameters["max_queued_generations"]["string_value"]) == QUEUED


def test_past_the_slots_and_the_queue_requests_are_rejected_clearly(fault_server):
    holders = [LongStream(fault_server) for _ in range(SLOTS)]
    try:
        with concurrent.futures.ThreadPoolExecutor(QUEUED) as pool:
            waiting = [pool.submit(http_generate, fault_server, text_input="hi", max_tokens=4)
                       for _ in range(QUEUED)]
            time.sleep(1.0)  # both are queued now
            started = time.monotonic()
            overflow = http_generate(fault_server, text_input="hi", max_tokens=4)
            assert time.monotonic() - started < 2.0, "the rejection past the queue must be immediate"
            assert overflow.status_code == MODEL_ERROR_HTTP_STATUS, overflow.text
            assert "server busy" in overflow.json()["error"]
            assert "already wait" in overflow.json()["error"]
            for future in waiting:
                resp = future.result(timeout=QUEUE_TIMEOUT_S + 30)
                assert resp.status_code == MODEL_ERROR_HTTP_STATUS, resp.text
                assert f"no KV slot became free within {QUEUE_TIMEOUT_S} s" in resp.json()["error"]
    finally:
        for holder in holders:
            holder.close()
    wait_slots_free(fault_server)
    assert http_generate(fault_server, text_input="hi", max_tokens=4).status_code == 200


def test_failing_draft_model_degrades_to_plain_decoding_visibly(fault_server):
    params = {"text_input": "def fibonacci(n):", "max_tokens": 24, "exclude_input_in_output": True}
    plain = generate_grpc(fault_server.grpc_url, {**params, "num_draft_tokens": 0})
    set_fault(fault_server, "draft_model", "error")
    try:
        degraded = generate_grpc(fault_server.grpc_url, {**params, "num_draft_tokens": 4, "drafter": "model"})
        # With prompt lookup in front, lookup keeps proposing (no model call) after the draft model failed.
        with_lookup = generate_grpc(fault_server.grpc_url, {**params, "num_draft_tokens": 4,
                                                            "drafter": "model+ngram"})
    finally:
        set_fault(fault_server, "draft_model", "")
    assert degraded.text == plain.text == with_lookup.text  # greedy: the same tokens either way
    assert degraded.stats["total_draft_tokens"] == 0 and degraded.stats["fallback_active"] == 1.0
    assert with_lookup.stats["fallback_active"] == 1.0
    assert "draft_model failed" in fault_server.log_file.read_text()
    # The counters are updated after the final response is sent: allow the model a moment.
    deadline = time.monotonic() + 15
    while True:
        metrics = requests.get(fault_server.metrics_url, timeout=10).text
        if any(line.startswith("specdec_errors_total") and 'kind="draft_failure"' in line
               for line in metrics.splitlines()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert any(line.startswith("specdec_errors_total") and 'kind="draft_failure"' in line
               for line in metrics.splitlines())
    wait_slots_free(fault_server)
    assert generate_grpc(fault_server.grpc_url, {**params, "num_draft_tokens": 4}).stats["total_draft_tokens"] > 0


def test_unloaded_draft_model_degrades_to_plain_decoding_until_reloaded(fault_server):
    admin = {ADMIN_KEY_HEADER: fault_server.admin_key}
    base = f"http://{fault_server.http_url}/v2/repository/models/draft_model"
    params = {"text_input": '{"id": 7, "name": "', "max_tokens": 16, "num_draft_tokens": 4, "drafter": "model"}
    assert requests.post(f"{base}/unload", headers=admin, timeout=60).status_code == 200
    try:
        degraded = generate_grpc(fault_server.grpc_url, params)
        assert degraded.num_output_tokens > 0 and degraded.stats["total_draft_tokens"] == 0
        assert degraded.stats["fallback_active"] == 1.0
    finally:
        assert requests.post(f"{base}/load", headers=admin, timeout=120).status_code == 200
    assert generate_grpc(fault_server.grpc_url, params).stats["total_draft_tokens"] > 0
    wait_slots_free(fault_server)


def test_failing_target_model_gives_clean_errors_and_frees_slots(fault_server):
    set_fault(fault_server, "target_model", "error")
    try:
        with pytest.raises(GenerationError, match="target_model: .*injected fault"):
            generate_grpc(fault_server.grpc_url, {"text_input": "hi", "max_tokens": 8})
        resp = http_generate(fault_server, text_input="hi", max_tokens=8)
        assert resp.status_code == MODEL_ERROR_HTTP_STATUS and "internal error: target_model" in resp.json()["error"]
    finally:
        set_fault(fault_server, "target_model", "")
    wait_slots_free(fault_server)
    assert http_generate(fault_server, text_input="hi", max_tokens=4).status_code == 200


def test_a_killed_model_process_gives_clean_errors_and_leaves_no_orphans(fault_server):
    """tritonserver 2.51 does not restart a dead model process: requests fail fast and cleanly (not hang), and
    after the server stops no model process or shared-memory region of it is left."""
    shm_before_start = fault_server.note_shm_regions()
    processes = set(session_processes(fault_server.process.pid)) - {fault_server.process.pid}
    target = [pid for pid in processes
              if "target_model" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")]
    assert len(target) == 1
    assert health.check(fault_server.http_url, timeout_s=30) is None
    os.kill(target[0], signal.SIGKILL)
    started = time.monotonic()
    resp = http_generate(fault_server, text_input="hi", max_tokens=4)
    assert resp.status_code == MODEL_ERROR_HTTP_STATUS and "not healthy" in resp.json()["error"]
    assert time.monotonic() - started < 30
    assert fault_server.dead_model_processes() == {"target_model_0_0": target[0]}
    # Triton still says live and ready; the deep check (a generation) does not.
    assert requests.get(f"http://{fault_server.http_url}/v2/health/ready", timeout=10).status_code == 200
    assert "not healthy" in health.check(fault_server.http_url, timeout_s=30)
    regions = fault_server.note_shm_regions() | shm_before_start
    session = fault_server.process.pid
    assert len(session_processes(session)) >= 5
    fault_server.stop()
    assert not session_processes(session)  # no model process outlives the server
    assert not [name for name in regions if (SHM_DIR / name).exists()]
    assert all(name.startswith(SHM_PREFIX) for name in regions) and len(regions) >= 5
