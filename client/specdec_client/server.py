"""Start and stop a real tritonserver (the 2.51.0 binary shipped in the nvidia-pytriton wheel).

Used by `make serve` and by the integration tests. Stopping is thorough: SIGTERM to the server, then to
every model process it started (they live in the server's process group), and removal of the Python
backend's shared-memory regions that this server's processes used (never another server's).

Safe defaults (docs/SECURITY.md): loopback only, model control off, and the admin APIs (model repository,
shared memory, trace, logging) refused unless the request carries the `specdec-admin-key` header with the
value of SPECDEC_ADMIN_KEY (a random key per start when unset).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from specdec.drafting.spec import DRAFTER_MODELS as MODEL_OF_DRAFTER
from specdec.drafting.spec import DrafterSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "triton_python_backend_shm_region_"
ABANDONED_PREFIX = "specdec_abandoned_"  # specdec.liveness: marks of abandoned generations, one folder per server
ADMIN_KEY_HEADER = "specdec-admin-key"
RESTRICTED_APIS = "model-repository,shared-memory,trace,logging"
# tritonserver 2.51 parses HTTP JSON recursively on its threads' stacks: with the usual 8 MiB a ~200 KB body of
# nested brackets kills the server; 64 MiB moves that past 1 MB (docs/SECURITY.md: cap bodies in front too).
STACK_LIMIT_KIB = 65536
SUPERVISE_INTERVAL_S = 2.0  # `make serve` checks this often that every model process is still alive


def pytriton_root() -> Path:
    """The tritonserver folder inside the installed nvidia-pytriton wheel (found without importing it)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("nvidia-pytriton is not installed: run `bash scripts/setup_env.sh`")
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver"


def server_environment() -> dict[str, str]:
    """Environment for tritonserver: its bundled libraries and this venv's python3 first on PATH.

    The Python backend starts model processes with `python3` from PATH in isolated mode, so the venv's
    interpreter (with torch, numpy<2 and this project installed) must come first.
    """
    site_packages = pytriton_root().parents[1]
    lib_dirs = [site_packages / "nvidia_pytriton.libs", site_packages / "nvidia" / "cuda_runtime" / "lib"]
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(d) for d in lib_dirs if d.is_dir()] + [p for p in [env.get("LD_LIBRARY_PATH")] if p]
    )
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def terminate(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM a process that is still running, SIGKILL it past `timeout_s`, and reap it."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def session_processes(session_id: int) -> list[int]:
    """Pids of the live processes in this session (the server and the model processes it started); exited
    processes not yet reaped (zombies) are left out."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if os.getsid(int(entry.name)) == session_id:
                    state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                    if state != "Z":
                        pids.append(int(entry.name))
    return pids


def model_processes(session_id: int) -> dict[str, int]:
    """Model instance name (e.g. target_model_0_0) -> pid of its Python-backend process, in this session."""
    found = {}
    for pid in session_processes(session_id):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            if "triton_python_backend_stub" in argv[0] and len(argv) > 3:
                found[argv[-3] if argv[-1] == "" else argv[-2]] = pid
    return found


def own_shm_regions(session_id: int) -> set[str]:
    """Python-backend shm regions that processes of this session map or were started with."""
    names: set[str] = set()
    pattern = re.compile(re.escape(SHM_PREFIX) + r"[\w-]+")
    for pid in session_processes(session_id):
        for source in ("maps", "cmdline"):
            with contextlib.suppress(OSError):
                names.update(pattern.findall(Path(f"/proc/{pid}/{source}").read_bytes().decode(errors="replace")))
    return names


@dataclass
class TritonServer:
    """A tritonserver process bound to loopback, usable as a context manager."""

    model_repository: Path = DEFAULT_MODEL_REPOSITORY
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "127.0.0.1"
    log_verbose: int = 0
    log_file: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    model_control_mode: str = "none"  # "explicit" loads every model and allows (admin-key) load/unload
    admin_key: str = field(default_factory=lambda: os.environ.get("SPECDEC_ADMIN_KEY") or secrets.token_urlsafe(24))
    process: subprocess.Popen | None = None
    _shm_seen: set[str] = field(default_factory=set)
    _model_processes: dict[str, int] = field(default_factory=dict)

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    def command(self) -> list[str]:
        root = pytriton_root()
        return [
            str(root / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={root / 'backends'}",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false",
            "--pinned-memory-pool-byte-size=0",
            f"--model-control-mode={self.model_control_mode}",
            *(["--load-model=*"] if self.model_control_mode == "explicit" else []),
            f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_KEY_HEADER}={self.admin_key}",
            f"--grpc-restricted-protocol={RESTRICTED_APIS}:{ADMIN_KEY_HEADER}={self.admin_key}",
            "--exit-timeout-secs=10",
            f"--log-verbose={self.log_verbose}",
            *self.extra_args,
        ]

    def start(self, timeout_s: float = 180.0) -> TritonServer:
        self._shm_seen = set()
        stdout = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115 - kept for the run
        # `ulimit -s` then exec: the server keeps this pid, and new threads get the larger default stack.
        launcher = ["/bin/sh", "-c", f'ulimit -s {STACK_LIMIT_KIB} 2>/dev/null; exec "$0" "$@"']
        self.process = subprocess.Popen(
            launcher + self.command(),
            env=server_environment(),
            stdout=stdout,
            stderr=subprocess.STDOUT if stdout else None,
            start_new_session=True,
        )
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} before READY")
            if self.is_ready():
                self.note_shm_regions()
                self._model_processes = model_processes(self.process.pid)
                return
            time.sleep(0.25)
        raise TimeoutError(f"tritonserver not READY after {timeout_s:.0f} s")

    def dead_model_processes(self) -> dict[str, int]:
        """Model instances whose process died (instance -> its last pid). tritonserver 2.51 never restarts one,
        and every request to its model fails from then on ("Stub process ... is not healthy") while
        /v2/health/ready stays 200. (An instance unloaded in explicit model control mode looks the same.)"""
        if self.process is None:
            return {}
        alive = model_processes(self.process.pid)
        self._model_processes.update(alive)  # a reloaded instance has a new process
        return {name: pid for name, pid in self._model_processes.items() if name not in alive}

    def note_shm_regions(self) -> set[str]:
        """Remember the shm regions this server's processes use now (stop() removes every one it saw)."""
        if self.process is not None:
            self._shm_seen |= own_shm_regions(self.process.pid)
        return set(self._shm_seen)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server, then every process of its session (the model stubs), then its shm regions."""
        proc = self.process
        if proc is None:
            return
        self.note_shm_regions()
        try:
            terminate(proc, timeout_s)
        finally:  # even when a second Ctrl-C interrupts the wait
            # Model stubs share the server's process group (start_new_session above).
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            deadline = time.monotonic() + timeout_s
            while session_processes(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            for name in self._shm_seen:
                with contextlib.suppress(FileNotFoundError):
                    (SHM_DIR / name).unlink()
            with contextlib.suppress(OSError):
                for mark in (SHM_DIR / f"{ABANDONED_PREFIX}{proc.pid}").iterdir():
                    mark.unlink()
                (SHM_DIR / f"{ABANDONED_PREFIX}{proc.pid}").rmdir()
            self.process = None

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_on_free_ports(model_repository: Path, log_file: Path, timeout_s: float = 240.0,
                        attempts: int = 2) -> TritonServer:
    """A started server on free loopback ports, started again once if it fails: tritonserver 2.51 now and
    then aborts at start-up on a loaded machine (boost::interprocess::lock_exception, docs/RELIABILITY.md)."""
    for attempt in range(1, attempts + 1):
        server = TritonServer(model_repository=model_repository, http_port=free_port(), grpc_port=free_port(),
                              metrics_port=free_port(), log_file=log_file)
        try:
            return server.start(timeout_s=timeout_s)
        except Exception:
            print(log_file.read_text()[-5000:] if log_file.exists() else "no server log")
            server.stop()
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


@dataclass
class OpenAIEndpoint:
    """The OpenAI-compatible endpoint (specdec_client.openai_api) in a process of its own, usable as a context
    manager; it talks to tritonserver at `triton_url` over gRPC."""

    triton_url: str
    port: int = 9000
    host: str = "127.0.0.1"
    extra_args: list[str] = field(default_factory=list)
    log_file: Path | None = None
    process: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout_s: float = 60.0) -> OpenAIEndpoint:
        stdout = open(self.log_file, "ab") if self.log_file else None  # noqa: SIM115 - kept for the run
        self.process = subprocess.Popen(
            [sys.executable, "-m", "specdec_client.openai_api", "--triton-url", self.triton_url, "--host", self.host,
             "--port", str(self.port), *self.extra_args],
            env=server_environment(), stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the OpenAI endpoint exited with code {self.process.returncode}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the OpenAI endpoint did not answer within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            terminate(proc, timeout_s)

    def __enter__(self) -> OpenAIEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


FIRST_REQUEST = "Write a Python function that checks whether a number is prime."


def answer_first_request(server: TritonServer, max_tokens: int = 96) -> None:
    """Send one chat request (the served target's chat template) and print its streamed answer: what a new
    user sees `make serve` do. A target without a chat template gets the message as a plain prompt."""
    from specdec_client.api import generate_grpc
    from specdec_client.generate import chat_prompt

    try:
        prompt = chat_prompt(FIRST_REQUEST, server.model_repository / "target_model" / "1")
    except SystemExit:
        prompt = FIRST_REQUEST
    print(f"\nfirst request (chat): {FIRST_REQUEST}\n", flush=True)
    try:
        result = generate_grpc(server.grpc_url, {"text_input": prompt, "max_tokens": max_tokens, "stream": True,
                                                 "exclude_input_in_output": True},
                               on_text=lambda text: print(text, end="", flush=True))
    except Exception as exc:  # the server keeps serving: this request only shows it working
        print(f"\n(first request failed: {exc})", flush=True)
        return
    stats = result.stats
    print(f"\n\n[{result.num_output_tokens} tokens in {result.latency_s:.2f} s, {result.tokens_per_second:.1f} "
          f"tokens/s, acceptance {stats.get('acceptance_rate', 0):.2f}]", flush=True)


DRAFTER_MODELS = tuple(MODEL_OF_DRAFTER.values())  # models only speculation needs; a deployment may leave one out


def repository_without(repository: Path, leave_out: list[str], dest: Path) -> Path:
    """`dest` made a model repository of links to `repository`'s model folders less the drafter models in
    `leave_out`: each drafter model loaded costs its process's memory (about 10% of the serving footprint with
    the default pair, docs/BENCHMARKS.md), and the speculation stage serves the drafters whose models it finds."""
    unknown = sorted(set(leave_out) - set(DRAFTER_MODELS))
    if unknown:
        raise ValueError(f"only drafter models can be left out ({', '.join(DRAFTER_MODELS)}), not {', '.join(unknown)}")
    dest.mkdir(parents=True, exist_ok=True)
    for folder in sorted(repository.iterdir()):
        if (folder / "config.pbtxt").is_file() and folder.name not in leave_out:
            (dest / folder.name).symlink_to(folder.resolve(), target_is_directory=True)
    return dest


def drafter_models_unused(repository: Path) -> list[str]:
    """The drafter models of `repository` that no task profile drafts with (profiles.yaml's `drafter`, e.g.
    `eagle+ngram` uses eagle_draft): what `--lean` leaves out. Requests that name another drafter then get an
    error saying it is not served here."""
    import yaml

    profiles = yaml.safe_load((repository / "speculative_decoding" / "1" / "profiles.yaml").read_text())
    drafters = profiles.get("speculative_decoding", profiles).get("drafter", "model")
    named = set(drafters.values()) if isinstance(drafters, dict) else {drafters}
    used = {model for name in named if (model := DrafterSpec.parse(name).triton_model) is not None}
    present = [model for model in DRAFTER_MODELS if (repository / model / "1" / "config.json").is_file()]
    if used and not used & set(present):  # the profiles' drafter model is absent: they draft with the one there is
        used = set(present[:1])
    return [model for model in present if model not in used]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve the specdec-triton model repository on loopback.")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    parser.add_argument("--host", default=os.environ.get("HOST", "127.0.0.1"))
    parser.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    parser.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    parser.add_argument("--openai-port", type=int, default=int(os.environ.get("OPENAI_PORT", 9000)),
                        help="port of the OpenAI-compatible endpoint (0: do not start it)")
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--no-first-request", dest="first_request", action="store_false",
                        help="do not send the chat request that shows the server answering once READY")
    parser.add_argument("--leave-out", action="append", default=[], choices=DRAFTER_MODELS,
                        help="do not load this drafter model (repeatable): the default profiles draft with the "
                             "EAGLE head, so `--leave-out draft_model` saves the draft model's process")
    parser.add_argument("--lean", action="store_true",
                        help="leave out the drafter models no task profile drafts with (the default repository: "
                             "the standalone draft model, as the profiles draft with the EAGLE head)")
    args = parser.parse_args(argv)
    repository = args.model_repository.resolve()
    if args.lean:
        args.leave_out = sorted({*args.leave_out, *drafter_models_unused(repository)})
    lean = None
    if args.leave_out:
        lean = Path(tempfile.mkdtemp(prefix="specdec-repository-"))
        repository = repository_without(repository, args.leave_out, lean / "model_repository")
        print(f"serving {args.model_repository} without {', '.join(args.leave_out)} (links in {repository})")
    server = TritonServer(
        model_repository=repository,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        host=args.host,
        log_verbose=args.log_verbose,
    )

    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    started = time.monotonic()
    # The endpoint applies the served target's chat template, whichever repository is served.
    tokenizer_args = ["--tokenizer", str(server.model_repository / "target_model" / "1")]
    openai = OpenAIEndpoint(server.grpc_url, args.openai_port, args.host, tokenizer_args) if args.openai_port else None
    try:
        server.start()
        if openai is not None:
            openai.start()
        if args.first_request:
            answer_first_request(server)
        print(
            f"\nspecdec-triton READY in {time.monotonic() - started:.1f} s  "
            f"(HTTP {server.http_url}, gRPC {server.grpc_url}, metrics {server.metrics_url})\n"
            "Send a request:\n"
            f"  .venv/bin/generate --url {server.grpc_url} --stream \"Write a JSON user record:\"\n"
            f"  curl -s -X POST http://{server.http_url}/v2/models/ensemble/generate "
            "-d '{\"text_input\": \"def fibonacci(n):\", \"max_tokens\": 64}'\n"
            + (f"  curl -s {openai.base_url}/completions -H 'content-type: application/json' "
               "-d '{\"model\": \"ensemble\", \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 64}'\n"
               f"  (OpenAI-compatible endpoint: {openai.base_url}, docs/OPENAI.md)\n" if openai else "")
            + "Ctrl-C stops the server.",
            flush=True,
        )
        assert server.process is not None
        while server.process.poll() is None:
            time.sleep(SUPERVISE_INTERVAL_S)
            if openai is not None and openai.process is not None and openai.process.poll() is not None:
                print(f"the OpenAI endpoint exited ({openai.process.returncode}); restarting it ...", flush=True)
                openai.start()
            dead = server.dead_model_processes()
            if dead:  # a model process died: restart the whole server rather than serve errors forever
                print(f"model process(es) of {sorted(dead)} died; restarting tritonserver ...", flush=True)
                server.stop()
                server.start()
                print(f"specdec-triton READY again (HTTP {server.http_url}, gRPC {server.grpc_url})", flush=True)
        return server.process.returncode
    except KeyboardInterrupt:
        return 0
    finally:
        print("stopping tritonserver ...", flush=True)
        if openai is not None:
            openai.stop()
        server.stop()
        if lean is not None:
            shutil.rmtree(lean, ignore_errors=True)  # links only: the models stay where they are


if __name__ == "__main__":
    sys.exit(main())
