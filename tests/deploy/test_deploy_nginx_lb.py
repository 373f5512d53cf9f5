"""Real load balancing on one machine: two tritonservers on loopback behind nginx (HTTP and gRPC), each
started by docker/entrypoint.sh as the images start it.

Traffic goes through nginx while one replica is stopped mid-run, three ways:
- drain: the replica leaves nginx (reload), then gets SIGTERM (a rolling update): nothing may fail;
- sigterm: SIGTERM only. tritonserver drains what it holds and drops new HTTP connections, which nginx
  re-sends to the survivor; gRPC requests reaching it during its final unload get NOT_FOUND in a normal gRPC
  response that nginx cannot retry (the reason to drain first), or CANCELLED when its gRPC server resets a
  call it had just accepted as it shuts down: only those may fail;
- crash: SIGKILL of the server and its model processes: only requests in flight on it may fail, with
  502 Bad Gateway (HTTP) or UNAVAILABLE (gRPC).
In every case, requests sent after the replica is gone all succeed on the survivor.

The model is a tiny Python-backend model that answers with the pid of the tritonserver that ran it, so each
response names its replica; nginx's access log (request id, upstream address) tells where failures went.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from deploy_helpers import EntrypointReplica, NginxLB, make_whoami_repository, nginx_binary
from specdec_client.server import free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(240),
    pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (scripts/setup_env.sh installs it)"),
]

SHORT_MS = 100  # most requests
LONG_MS = 8000  # still in flight when the victim goes
# nginx re-runs a request whose replica died only within *_next_upstream_timeout (5 s) of the request's start
# (and HTTP only: a gRPC request body is streamed, not buffered). Before the crash, the long requests get
# older than that, so those on the victim must fail with a clear error instead of running twice.
RETRY_WINDOW_S = 5.0


def _require_tritonserver() -> None:
    try:
        from specdec_client.server import pytriton_root

        if not (pytriton_root() / "bin" / "tritonserver").exists():
            raise RuntimeError("no tritonserver binary")
    except Exception as exc:  # noqa: BLE001 - any reason means: no server on this machine
        pytest.skip(f"tritonserver is not available: {exc}")


@dataclass
class Result:
    rid: str
    proto: str
    delay_ms: int
    start: float
    end: float
    pid: int | None = None
    error: str | None = None


def http_infer(url: str, delay_ms: int) -> Result:
    rid = uuid.uuid4().hex
    body = json.dumps(
        {"inputs": [{"name": "delay_ms", "shape": [1], "datatype": "INT32", "data": [delay_ms]}]}
    ).encode()
    request = urllib.request.Request(
        f"http://{url}/v2/models/whoami/infer",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "X-Request-ID": rid},
    )
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            payload = json.loads(response.read())
        return Result(rid, "http", delay_ms, start, time.monotonic(), pid=int(payload["outputs"][0]["data"][0]))
    except urllib.error.HTTPError as exc:
        return Result(rid, "http", delay_ms, start, time.monotonic(), error=f"HTTP {exc.code} {exc.reason}")
    except OSError as exc:
        return Result(rid, "http", delay_ms, start, time.monotonic(), error=f"connection: {exc!r}")


class GrpcCaller:
    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self._grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(url=url)

    def __call__(self, delay_ms: int) -> Result:
        from tritonclient.utils import InferenceServerException

        rid = uuid.uuid4().hex
        tensor = self._grpc.InferInput("delay_ms", [1], "INT32")
        tensor.set_data_from_numpy(np.array([delay_ms], dtype=np.int32))
        start = time.monotonic()
        try:
            result = self.client.infer("whoami", [tensor], headers={"x-request-id": rid}, client_timeout=30)
            pid = int(result.as_numpy("server_pid")[0])
            return Result(rid, "grpc", delay_ms, start, time.monotonic(), pid=pid)
        except InferenceServerException as exc:
            return Result(rid, "grpc", delay_ms, start, time.monotonic(), error=f"{exc.status()} {exc.message()}")

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def two_replicas_behind_nginx(tmp_path: Path):
    """Two replicas started the way the images start them (docker/entrypoint.sh), nginx in front."""
    _require_tritonserver()
    repo = make_whoami_repository(tmp_path / "repo")
    servers = [
        EntrypointReplica(
            workdir=tmp_path / f"replica{i}",
            model_repository=repo,
            deployment=None,
            http_port=free_port(),
            grpc_port=free_port(),
            metrics_port=free_port(),
            extra_env={"SPECDEC_EXIT_TIMEOUT_S": "20"},  # drain (up to LONG_MS) + unload (about 5 s)
        )
        for i in range(2)
    ]
    lb = NginxLB(
        http_backends=[s.http_port for s in servers],
        grpc_backends=[s.grpc_port for s in servers],
        http_port=free_port(),
        grpc_port=free_port(),
    )
    try:
        with ThreadPoolExecutor(2) as pool:  # both start at once: about 3 s instead of 6
            list(pool.map(lambda s: s.start(timeout_s=120), servers))
        lb.start()
        yield servers, lb
    finally:
        lb.stop()
        for server in servers:
            server.stop()
        if lb.error_log.exists():
            (tmp_path / "nginx-error.log").write_text(lb.error_log.read_text())
        if lb.access_log.exists():
            (tmp_path / "nginx-access.log").write_text(lb.access_log.read_text())
        lb.cleanup()


def _summary(results: list[Result]) -> str:
    return "; ".join(f"{r.proto} +{r.delay_ms}ms {r.error or r.pid}" for r in results[:8])


@pytest.mark.parametrize("mode", ["drain", "sigterm", "crash"])
def test_traffic_survives_losing_a_replica(two_replicas_behind_nginx, mode: str) -> None:
    """drain: the replica leaves nginx (reload), then gets SIGTERM, the rolling-update procedure;
    sigterm: SIGTERM only, nginx not told; crash: SIGKILL of the replica and its model processes."""
    servers, lb = two_replicas_behind_nginx
    victim, survivor = servers
    victim_pid, survivor_pid = victim.pid, survivor.pid
    http_url, grpc_url = f"127.0.0.1:{lb.http_port}", f"127.0.0.1:{lb.grpc_port}"

    results: list[Result] = []
    lock = threading.Lock()
    stop_traffic = threading.Event()
    deadline = time.monotonic() + 60  # hard bound on the traffic loops whatever happens

    def loop(call) -> None:
        count = 0
        while not stop_traffic.is_set() and time.monotonic() < deadline and count < 2000:
            result = call(SHORT_MS)
            count += 1
            with lock:
                results.append(result)

    grpc_callers = [GrpcCaller(grpc_url) for _ in range(3)]
    workers = [threading.Thread(target=loop, args=(lambda d: http_infer(http_url, d),)) for _ in range(2)]
    workers += [threading.Thread(target=loop, args=(caller,)) for caller in grpc_callers[:2]]
    long_pool = ThreadPoolExecutor(4)
    try:
        for worker in workers:
            worker.start()
        time.sleep(1.0)
        # Long requests, in flight when the victim goes away: with round-robin, some land on each replica.
        long_futures = [long_pool.submit(http_infer, http_url, LONG_MS) for _ in range(2)]
        long_futures += [long_pool.submit(grpc_callers[2], LONG_MS) for _ in range(2)]
        time.sleep(RETRY_WINDOW_S + 0.5 if mode == "crash" else 1.0)

        stop_began = time.monotonic()
        if mode == "drain":
            lb.set_backends([survivor.http_port], [survivor.grpc_port])
            assert victim.terminate() == 0  # SIGTERM: tritonserver finishes what it holds, then exits
        elif mode == "sigterm":
            assert victim.terminate() == 0
        else:
            victim.kill()
        stopped = time.monotonic()
        time.sleep(3.0)
        stop_traffic.set()
        for worker in workers:
            worker.join(timeout=60)
        long_results = [f.result(timeout=60) for f in long_futures]
    finally:
        stop_traffic.set()
        long_pool.shutdown(wait=True)
        for caller in grpc_callers:
            caller.close()

    all_results = results + long_results
    before = [r for r in all_results if r.end < stop_began]
    after = [r for r in all_results if r.start > stopped]
    failures = [r for r in all_results if r.error is not None]
    log = lb.entries_for([r.rid for r in failures + long_results])
    log.update({e["rid"]: e for e in lb.access_entries() if e["rid"] not in log})
    victim_addrs = {f"127.0.0.1:{victim.http_port}", f"127.0.0.1:{victim.grpc_port}"}
    print(
        f"{mode}: {len(all_results)} requests, {len(before)} before the stop, {len(after)} after it, "
        f"stop took {stopped - stop_began:.1f} s, {len(failures)} failed: {_summary(failures)}"
    )

    # Both replicas served through nginx before the stop, over both protocols.
    for proto in ("http", "grpc"):
        pids = {r.pid for r in before if r.proto == proto and r.pid is not None}
        assert pids == {victim_pid, survivor_pid}, f"{proto}: replicas seen before the stop: {pids}"
    assert {r.pid for r in all_results if r.pid is not None} <= {victim_pid, survivor_pid}

    # Once the victim is gone, every new request succeeds, on the survivor, over both protocols.
    assert len([r for r in after if r.proto == "http"]) >= 5 and len([r for r in after if r.proto == "grpc"]) >= 5
    bad_after = [r for r in after if r.error is not None or r.pid != survivor_pid]
    assert not bad_after, f"requests after the stop that failed or hit the victim: {_summary(bad_after)}"

    # Failures: only on the victim, only while it was going away, each with a clear error.
    for r in failures:
        assert r.start < stopped and r.end > stop_began, f"failed outside the stop window: {r}"
        assert r.rid in log, f"failed request {r.rid} is not in nginx's access log"
        assert log[r.rid]["upstream"] in victim_addrs, f"failed request went to the survivor: {log[r.rid]}"
        if r.proto == "http":
            assert r.error.startswith("HTTP 502"), r.error
        else:
            # CANCELLED: tritonserver's gRPC server, shutting down, resets a call it had just accepted
            # (seen once in CI, sigterm mode); nginx passes the reset on.
            allowed = ("StatusCode.UNAVAILABLE", "StatusCode.NOT_FOUND")
            if mode == "sigterm":
                allowed += ("StatusCode.CANCELLED",)
            assert r.error.startswith(allowed), r.error

    def first_upstream(r: Result) -> str:
        return log[r.rid]["upstreams"].split(",")[0].strip() if r.rid in log else ""

    long_on_victim = [r for r in long_results if first_upstream(r) in victim_addrs]
    long_elsewhere = [r for r in long_results if r not in long_on_victim]
    assert all(r.error is None and r.pid == survivor_pid for r in long_elsewhere), _summary(long_elsewhere)
    if mode == "drain":
        # The procedure for a planned stop: nothing is lost, in flight or new, on either protocol.
        assert not failures, f"drain-then-stop lost requests: {_summary(failures)}"
        assert all(r.pid == victim_pid for r in long_on_victim), _summary(long_on_victim)
    elif mode == "sigterm":
        # tritonserver drains what it holds; nginx re-sends the HTTP requests it drops. gRPC requests that
        # reach it while it drains get NOT_FOUND ("... has no available versions") in a normal gRPC
        # response, which nginx cannot tell from an answer: the reason to drain nginx (or let Kubernetes
        # remove the endpoint, preStop) before SIGTERM. A call its gRPC server had just accepted as it shut
        # down is reset: CANCELLED.
        assert all(r.pid == victim_pid for r in long_on_victim), _summary(long_on_victim)
        assert not [r for r in failures if r.proto == "http"], _summary(failures)
        for r in failures:
            assert "has no available versions" in r.error or r.error.startswith("StatusCode.CANCELLED"), r
    else:
        # A long request on the crashed replica was older than the retry window: it fails, it is not re-run.
        assert all(r.error is not None for r in long_on_victim), _summary(long_on_victim)
