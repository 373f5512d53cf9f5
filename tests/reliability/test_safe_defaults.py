"""Safe defaults, checked without a server: loopback only, model control off, admin APIs behind a key, a stack
that survives deeply nested JSON, limits on request size and length, bounded queues, and no unsafe
deserialization anywhere in the serving path."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from google.protobuf import text_format
from specdec_client.server import ADMIN_KEY_HEADER, RESTRICTED_APIS, STACK_LIMIT_KIB, TritonServer
from specdec_client.soak import require_loopback
from tritonclient.grpc import model_config_pb2 as mc

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVING_CODE = ("python_backend", "model_repository", "client")


def flags(server: TritonServer) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for arg in server.command():
        if arg.startswith("--") and "=" in arg:
            key, value = arg.split("=", 1)
            values.setdefault(key, []).append(value)
    return values


def test_launcher_binds_loopback_with_model_control_off_and_admin_apis_restricted():
    server = TritonServer(admin_key="k3y")
    args = flags(server)
    for name in ("--http-address", "--grpc-address", "--metrics-address"):
        assert args[name] == ["127.0.0.1"]
    assert args["--model-control-mode"] == ["none"] and "--load-model" not in args
    expected = f"{RESTRICTED_APIS}:{ADMIN_KEY_HEADER}=k3y"
    assert args["--http-restricted-api"] == [expected] and args["--grpc-restricted-protocol"] == [expected]
    for api in ("model-repository", "shared-memory"):
        assert api in RESTRICTED_APIS.split(",")


def test_admin_key_is_random_per_server_unless_configured(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("SPECDEC_ADMIN_KEY", raising=False)
    first, second = TritonServer().admin_key, TritonServer().admin_key
    assert first != second and len(first) >= 24
    monkeypatch.setenv("SPECDEC_ADMIN_KEY", "from-the-environment")
    assert TritonServer().admin_key == "from-the-environment"


def test_stack_limit_covers_nested_json_that_kills_the_default_stack():
    # 150000 nested brackets crash tritonserver 2.51 on an 8 MiB stack (measured); 64 MiB survives 600000.
    assert STACK_LIMIT_KIB >= 64 * 1024


@pytest.mark.parametrize("address", ["127.0.0.1:8001", "localhost:8000", "[::1]:8001", "http://127.0.0.1:8002"])
def test_load_tools_accept_loopback(address: str):
    require_loopback(address)


@pytest.mark.parametrize("address", ["10.0.0.7:8001", "0.0.0.0:8001", "example.com:8000", "192.168.1.2:80"])
def test_load_tools_refuse_anything_else(address: str):
    with pytest.raises(SystemExit, match="loopback only"):
        require_loopback(address)


def committed_config(model: str) -> mc.ModelConfig:
    text = (REPO_ROOT / "model_repository" / model / "config.pbtxt").read_text()
    return text_format.Parse(text, mc.ModelConfig())


def test_committed_configs_limit_request_size_length_and_queues():
    pre = committed_config("preprocessing")
    assert 0 < int(pre.parameters["max_input_bytes"].string_value) <= 1 << 20
    spec = committed_config("speculative_decoding")
    params = {key: value.string_value for key, value in spec.parameters.items()}
    assert 0 < int(params["max_tokens_limit"]) <= int(params["max_context_length"])
    assert int(params["max_concurrent_sequences"]) == int(committed_config("target_model").max_batch_size)
    assert int(params["max_queued_generations"]) > 0 and float(params["queue_timeout_s"]) > 0
    assert float(params["max_generation_s"]) > 0
    for config in (pre, spec):
        policy = config.dynamic_batching.default_queue_policy
        assert policy.max_queue_size > 0 and policy.default_timeout_microseconds > 0
        assert policy.timeout_action == mc.ModelQueuePolicy.TimeoutAction.Value("REJECT")


UNSAFE_CALLS = {
    ("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("marshal", "load"), ("marshal", "loads"),
    ("dill", "load"), ("dill", "loads"), ("shelve", "open"), ("jsonpickle", "decode"), ("yaml", "unsafe_load"),
    ("yaml", "full_load"),
}


def unsafe_calls(path: Path) -> list[str]:
    """Calls that can run code from the data they read (AST scan: comments and strings do not count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func, keywords = node.func, {kw.arg: kw.value for kw in node.keywords}
        if isinstance(func, ast.Name) and func.id in ("eval", "exec"):
            found.append(f"{path}:{node.lineno} {func.id}()")
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)):
            continue
        call = (func.value.id, func.attr)
        if call in UNSAFE_CALLS:
            found.append(f"{path}:{node.lineno} {'.'.join(call)}()")
        if call == ("yaml", "load") and "Loader" not in keywords:
            found.append(f"{path}:{node.lineno} yaml.load() without a safe Loader")
        if call == ("torch", "load"):
            weights_only = keywords.get("weights_only")
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                found.append(f"{path}:{node.lineno} torch.load() without weights_only=True")
        if call in (("np", "load"), ("numpy", "load")):
            allow = keywords.get("allow_pickle")
            if isinstance(allow, ast.Constant) and allow.value:
                found.append(f"{path}:{node.lineno} np.load(allow_pickle=True)")
    return found


def test_nothing_in_the_serving_path_deserializes_unsafely():
    files = [p for folder in SERVING_CODE for p in (REPO_ROOT / folder).rglob("*.py") if ".venv" not in p.parts]
    assert len(files) > 20
    problems = [problem for path in files for problem in unsafe_calls(path)]
    assert not problems, "\n".join(problems)


def test_the_scan_finds_what_it_looks_for(tmp_path: Path):
    sample = tmp_path / "bad.py"
    sample.write_text("import pickle, torch, yaml\npickle.loads(b'')\ntorch.load('x')\nyaml.load('a')\neval('1')\n"
                      "torch.load('y', weights_only=True)\nyaml.load('a', Loader=yaml.SafeLoader)\n")
    assert len(unsafe_calls(sample)) == 4
