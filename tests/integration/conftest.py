"""A real tritonserver on free loopback ports, started once for the integration tests and stopped cleanly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from specdec_client.server import TritonServer, free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS = json.loads((REPO_ROOT / "client/specdec_client/prompts/smoke.json").read_text())


def model_repository() -> Path:
    return Path(os.environ.get("SPECDEC_TEST_MODEL_REPOSITORY", REPO_ROOT / "model_repository"))


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("triton") / "server.log"
    # One retry: tritonserver 2.51 now and then aborts at start-up on a loaded machine
    # (boost::interprocess::lock_exception, docs/RELIABILITY.md); a second start is clean.
    for attempt in (1, 2):
        instance = TritonServer(model_repository=model_repository(), http_port=free_port(), grpc_port=free_port(),
                                metrics_port=free_port(), log_file=log)
        try:
            instance.start(timeout_s=240)
            break
        except Exception:
            print(log.read_text()[-5000:] if log.exists() else "no server log")
            if attempt == 2:
                raise
    yield instance
    instance.stop()


@pytest.fixture(scope="session")
def all_prompts() -> list[tuple[str, str]]:
    return [(domain, prompt) for domain, prompts in PROMPTS.items() for prompt in prompts]
