"""The autoscaler's metric means what the chart says it means, measured on a real tritonserver.

deploy/prometheus-adapter/values.yaml turns nv_inference_queue_duration_us into
`sum(rate(...)) / 1e6` per pod: seconds of queueing per second, which by Little's law is the mean number of
requests waiting. Here a closed loop of C clients keeps a model with N instances of S-second requests busy:
C - N requests wait on average, and the rate computed the adapter's way from two scrapes must say so.
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from deploy_helpers import EntrypointReplica, make_whoami_repository

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

CLIENTS, INSTANCES, SERVICE_MS, WINDOW_S = 6, 4, 300, 4.0


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode()


def total(text: str, family: str) -> float:
    """Sum over all series of a family (the adapter's `sum(...) by (pod)` for one pod)."""
    return sum(float(v) for v in re.findall(rf"^{family}\{{[^}}]*\}} (\S+)$", text, re.M))


def test_queue_metric_is_the_mean_number_of_waiting_requests(tmp_path: Path) -> None:
    try:
        from specdec_client.server import free_port, pytriton_root

        assert (pytriton_root() / "bin" / "tritonserver").exists()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"tritonserver is not available: {exc}")
    repo = make_whoami_repository(tmp_path / "repo")
    assert f"count: {INSTANCES} " in (repo / "whoami" / "config.pbtxt").read_text()
    replica = EntrypointReplica(
        workdir=tmp_path / "replica",
        model_repository=repo,
        deployment=None,
        http_port=free_port(),
        grpc_port=free_port(),
        metrics_port=free_port(),
    )
    body = json.dumps({"inputs": [{"name": "delay_ms", "shape": [1], "datatype": "INT32", "data": [SERVICE_MS]}]})
    stop = threading.Event()
    pending_samples: list[float] = []

    def client() -> None:
        for _ in range(100):  # bounded
            if stop.is_set():
                return
            request = urllib.request.Request(
                f"http://127.0.0.1:{replica.http_port}/v2/models/whoami/infer", data=body.encode(), method="POST"
            )
            with urllib.request.urlopen(request, timeout=30) as resp:
                resp.read()

    try:
        replica.start(timeout_s=120)
        threads = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)  # steady state
        t0, first = time.monotonic(), scrape(replica.metrics_port)
        while time.monotonic() - t0 < WINDOW_S:
            time.sleep(0.5)
            pending_samples.append(total(scrape(replica.metrics_port), "nv_inference_pending_request_count"))
        t1, second = time.monotonic(), scrape(replica.metrics_port)
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
    finally:
        stop.set()
        replica.stop()

    family = "nv_inference_queue_duration_us"
    waiting = (total(second, family) - total(first, family)) / (t1 - t0) / 1e6
    expected = CLIENTS - INSTANCES
    print(f"queue seconds per second {waiting:.2f} (expected about {expected}); pending samples {pending_samples}")
    assert expected * 0.6 <= waiting <= expected * 1.3
    # The faster gauge of the second adapter rule agrees on average.
    assert expected * 0.5 <= sum(pending_samples) / len(pending_samples) <= expected * 1.5
