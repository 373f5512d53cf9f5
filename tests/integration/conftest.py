"""A real tritonserver on free loopback ports, started once for the integration tests and stopped cleanly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from specdec_client.server import start_on_free_ports

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMPTS = json.loads((REPO_ROOT / "client/specdec_client/prompts/smoke.json").read_text())


def model_repository() -> Path:
    return Path(os.environ.get("SPECDEC_TEST_MODEL_REPOSITORY", REPO_ROOT / "model_repository"))


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    instance = start_on_free_ports(model_repository(), tmp_path_factory.mktemp("triton") / "server.log")
    yield instance
    instance.stop()


@pytest.fixture(scope="session")
def all_prompts() -> list[tuple[str, str]]:
    return [(domain, prompt) for domain, prompts in PROMPTS.items() for prompt in prompts]
