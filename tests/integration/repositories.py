"""Temporary model repositories for integration tests that need a server of their own: the test pair's model
files symlinked, configs rendered from a deployment by build/render_configs.py."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from google.protobuf import text_format

REPO_ROOT = Path(__file__).resolve().parents[2]


def render_module():
    spec = importlib.util.spec_from_file_location("render_configs", REPO_ROOT / "build" / "render_configs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_repository(root: Path, deployment: dict, leave_out: tuple[str, ...] = ()) -> Path:
    """The test pair's models (files symlinked; tests/conftest.py names the pair) less `leave_out`, with
    configs rendered from `deployment`. An optional decoder the pair has no checkpoint of is left out too."""
    render = render_module()
    for name, config in render.render(deployment).items():
        source = Path(os.environ["SPECDEC_TEST_MODEL_REPOSITORY"]) / name / "1"
        if name in leave_out or (name in render.OPTIONAL_DECODERS and not source.is_dir()):
            continue
        version = root / name / "1"
        version.mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(text_format.MessageToString(config))
        for item in source.iterdir():
            if item.name != "__pycache__":
                (version / item.name).symlink_to(item)
    return root


def cpu_deployment() -> dict:
    import yaml

    return yaml.safe_load((REPO_ROOT / "build" / "deployments" / "cpu.yaml").read_text())
