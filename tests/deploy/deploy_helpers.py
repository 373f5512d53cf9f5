"""Helpers for the deployment tests: the nginx load balancer, a tiny model repository, the helm binary.

Nothing here needs a Kubernetes cluster or a Docker engine.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
NGINX_TEMPLATE = REPO_ROOT / "deploy" / "nginx" / "specdec.conf.template"
CHART_DIR = REPO_ROOT / "deploy" / "helm" / "specdec-triton"

# The two supported value sets: production (GPU, TensorRT) and development (CPU).
VALUE_SETS = {"gpu": [], "cpu": [CHART_DIR / "values-cpu.yaml"]}


def helm_template(helm: Path, values: list[Path], *extra: str, namespace: str = "llm") -> list[dict]:
    cmd = [str(helm), "template", "specdec", str(CHART_DIR), "--namespace", namespace]
    for path in values:
        cmd += ["-f", str(path)]
    out = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise AssertionError(f"helm template failed:\n{out.stderr}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


_VAR = re.compile(r"\$\{(SPECDEC_[A-Z_]+)\}")


def render_template(text: str, values: dict[str, str]) -> str:
    """envsubst semantics restricted to ${SPECDEC_*}: nginx's own $variables are left alone.

    Unlike envsubst, a variable without a value is an error, not an empty string.
    """
    missing = sorted({m.group(1) for m in _VAR.finditer(text)} - values.keys())
    if missing:
        raise KeyError(f"no value for {', '.join(missing)}")
    return _VAR.sub(lambda m: values[m.group(1)], text)


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


def wait_port(port: int, timeout_s: float, host: str = "127.0.0.1", proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with code {proc.returncode} before port {port} opened")
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
            sock.settimeout(0.5)
            if sock.connect_ex((host, port)) == 0:
                return
        time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout_s:.0f} s")


@dataclass
class NginxLB:
    """nginx in the foreground (daemon off) on 127.0.0.1, config and logs in a private temp folder."""

    http_backends: list[int]
    grpc_backends: list[int]
    http_port: int
    grpc_port: int
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="specdec-nginx-")))
    process: subprocess.Popen | None = None

    @property
    def access_log(self) -> Path:
        return self.workdir / "access.log"

    @property
    def error_log(self) -> Path:
        return self.workdir / "error.log"

    def write_config(self) -> Path:
        # Workers run as `nobody` when the master is root: they need to reach their temp folders.
        self.workdir.chmod(0o755)
        temp_dirs = {}
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            path = self.workdir / "temp" / name
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(0o777)
            temp_dirs[name] = path
        (self.workdir / "temp").chmod(0o755)

        def upstreams(ports: list[int]) -> str:
            return " ".join(f"server 127.0.0.1:{p} max_fails=1 fail_timeout=10s;" for p in ports)

        snippet = render_template(
            NGINX_TEMPLATE.read_text(),
            {
                "SPECDEC_HTTP_UPSTREAMS": upstreams(self.http_backends),
                "SPECDEC_GRPC_UPSTREAMS": upstreams(self.grpc_backends),
                "SPECDEC_HTTP_LISTEN": f"127.0.0.1:{self.http_port}",
                "SPECDEC_GRPC_LISTEN": f"127.0.0.1:{self.grpc_port}",
                "SPECDEC_ACCESS_LOG": str(self.access_log),
            },
        )
        (self.workdir / "specdec.conf").write_text(snippet)
        conf = self.workdir / "nginx.conf"
        conf.write_text(
            textwrap.dedent(
                f"""\
                daemon off;
                worker_processes 1;
                pid {self.workdir / "nginx.pid"};
                error_log {self.error_log} info;
                events {{ worker_connections 512; }}
                http {{
                    client_body_temp_path {temp_dirs["client_body"]};
                    proxy_temp_path {temp_dirs["proxy"]};
                    fastcgi_temp_path {temp_dirs["fastcgi"]};
                    uwsgi_temp_path {temp_dirs["uwsgi"]};
                    scgi_temp_path {temp_dirs["scgi"]};
                    include {self.workdir / "specdec.conf"};
                }}
                """
            )
        )
        return conf

    def command(self, *extra: str) -> list[str]:
        binary = nginx_binary()
        if binary is None:
            raise FileNotFoundError("nginx is not installed (Debian package `nginx`)")
        conf = self.workdir / "nginx.conf"
        return [binary, "-p", str(self.workdir), "-c", str(conf), "-e", str(self.error_log), *extra]

    def start(self, timeout_s: float = 10.0) -> NginxLB:
        self.write_config()
        check = subprocess.run(self.command("-t"), capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise RuntimeError(f"nginx -t rejected the rendered config:\n{check.stderr}")
        self.process = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        try:
            wait_port(self.http_port, timeout_s, proc=self.process)
            wait_port(self.grpc_port, timeout_s, proc=self.process)
        except BaseException:
            self.stop()
            raise
        return self

    def set_backends(self, http_backends: list[int], grpc_backends: list[int], timeout_s: float = 10.0) -> None:
        """Rewrite the upstreams and reload (SIGHUP): new workers route new requests, old ones finish theirs."""
        assert self.process is not None and self.process.poll() is None, "nginx is not running"
        self.http_backends, self.grpc_backends = list(http_backends), list(grpc_backends)
        started_before = self._worker_starts()
        self.write_config()
        check = subprocess.run(self.command("-t"), capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise RuntimeError(f"nginx -t rejected the rendered config:\n{check.stderr}")
        self.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout_s
        while self._worker_starts() <= started_before:
            if time.monotonic() > deadline:
                raise TimeoutError("nginx did not start new workers after SIGHUP")
            time.sleep(0.05)

    def _worker_starts(self) -> int:
        text = self.error_log.read_text() if self.error_log.exists() else ""
        return text.count("start worker process")

    def access_entries(self) -> list[dict[str, str]]:
        """The access log as dicts: rid, status, upstream (last peer tried), upstreams (all), request."""
        entries = []
        if not self.access_log.exists():
            return entries
        pattern = re.compile(
            r'rid=(?P<rid>\S*) "(?P<request>[^"]*)" status=(?P<status>\d+) upstream=(?P<upstreams>.*?) '
            r"upstream_status=(?P<upstream_status>.*?) rt="
        )
        for line in self.access_log.read_text().splitlines():
            match = pattern.search(line)
            if match:
                entry = match.groupdict()
                entry["upstream"] = entry["upstreams"].split(",")[-1].strip().split(" : ")[-1].strip()
                entries.append(entry)
        return entries

    def entries_for(self, rids: list[str], timeout_s: float = 10.0) -> dict[str, dict[str, str]]:
        """Access-log entries of these request ids. nginx logs a request when it finalises it, which can be a
        moment after the client has its response (a gRPC stream's trailers), so wait for them."""
        deadline = time.monotonic() + timeout_s
        while True:
            log = {e["rid"]: e for e in self.access_entries()}
            missing = [rid for rid in rids if rid not in log]
            if not missing or time.monotonic() > deadline:
                return {rid: log[rid] for rid in rids if rid in log}
            time.sleep(0.1)

    def stop(self) -> None:
        proc = self.process
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGQUIT)  # graceful: finish open requests, then exit
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.stderr is not None:
            proc.stderr.close()
        self.process = None

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> NginxLB:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()


WHOAMI_CONFIG = """\
name: "whoami"
backend: "python"
max_batch_size: 0
input [ { name: "delay_ms" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "server_pid" data_type: TYPE_INT64 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 4 } ]
"""

WHOAMI_MODEL = '''\
"""Answers with the process id of the tritonserver that runs it (the stub's parent), after delay_ms."""
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            delay_ms = int(pb_utils.get_input_tensor_by_name(request, "delay_ms").as_numpy().reshape(-1)[0])
            time.sleep(max(delay_ms, 0) / 1000.0)
            pid = pb_utils.Tensor("server_pid", np.array([os.getppid()], dtype=np.int64))
            responses.append(pb_utils.InferenceResponse(output_tensors=[pid]))
        return responses
'''


def make_whoami_repository(root: Path) -> Path:
    """A one-model repository whose answers tell which replica served them."""
    (root / "whoami" / "1").mkdir(parents=True, exist_ok=True)
    (root / "whoami" / "config.pbtxt").write_text(WHOAMI_CONFIG)
    (root / "whoami" / "1" / "model.py").write_text(WHOAMI_MODEL)
    return root


SHM_DIR = Path("/dev/shm")


def mapped_shm_regions(pid: int) -> set[str]:
    """The Python-backend shared-memory regions a tritonserver process has mapped (its own, no one else's)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return set(re.findall(r"/dev/shm/(triton_python_backend_shm_region_\S+)", maps))


def remove_shm_regions(names: set[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / name).unlink()


@dataclass
class EntrypointReplica:
    """docker/entrypoint.sh run as a container would run it, minus the container: the CPU image's layout is
    mimicked with SPECDEC_HOME=<this checkout> and TRITONSERVER=docker/tritonserver-cpu.sh, and this venv's
    python3 first on PATH. Bound to 127.0.0.1 on the given ports."""

    workdir: Path
    http_port: int
    grpc_port: int
    metrics_port: int
    model_repository: Path = field(default_factory=lambda: Path(os.environ.get(
        "SPECDEC_TEST_MODEL_REPOSITORY", REPO_ROOT / "model_repository")))  # tests/conftest.py: the fixture pair
    deployment: Path | None = REPO_ROOT / "build" / "deployments" / "cpu.yaml"  # None: serve the repository as is
    extra_env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen | None = None

    @property
    def run_repository(self) -> Path:
        return self.workdir / "model_repository"

    @property
    def log_file(self) -> Path:
        return self.workdir / "server.log"

    def environment(self) -> dict[str, str]:
        import sys

        env = dict(os.environ)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        env.update(
            SPECDEC_HOME=str(REPO_ROOT),
            SPECDEC_MODEL_REPOSITORY=str(self.model_repository),
            SPECDEC_DEPLOYMENT=str(self.deployment) if self.deployment else "",
            SPECDEC_RUN_REPOSITORY=str(self.run_repository),
            TRITONSERVER=str(REPO_ROOT / "docker" / "tritonserver-cpu.sh"),
            HTTP_PORT=str(self.http_port),
            GRPC_PORT=str(self.grpc_port),
            METRICS_PORT=str(self.metrics_port),
            SPECDEC_EXIT_TIMEOUT_S="20",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
        )
        env.update(self.extra_env)
        return env

    def command(self) -> list[str]:
        loopback = ["--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1"]
        return ["bash", str(REPO_ROOT / "docker" / "entrypoint.sh"), *loopback]

    def start(self, timeout_s: float = 240.0) -> EntrypointReplica:
        import urllib.request

        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), env=self.environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log_file.read_text()[-3000:]
                raise RuntimeError(f"entrypoint exited with {self.process.returncode} before READY:\n{tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"not READY after {timeout_s:.0f} s")

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (what Kubernetes and `docker stop` send); the exit code."""
        assert self.process is not None
        regions = mapped_shm_regions(self.process.pid)
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=timeout_s)
        remove_shm_regions(regions)
        return code

    def kill(self) -> None:
        """A crash: SIGKILL to the server and all its model processes."""
        assert self.process is not None
        regions = mapped_shm_regions(self.process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)
        remove_shm_regions(regions)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self) -> None:
        proc = self.process
        if proc is None:
            return
        regions = mapped_shm_regions(proc.pid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        remove_shm_regions(regions)
        self.process = None
