#!/usr/bin/env bash
# `tritonserver` of the CPU image: the 2.51.0 binary shipped in the nvidia-pytriton wheel, with the libraries
# and backends of that wheel (as client/specdec_client/server.py runs it). Installed as
# /usr/local/bin/tritonserver by docker/Dockerfile.cpu; arguments are passed through.
set -euo pipefail
PYTHON="${SPECDEC_PYTHON:-python3}"
root="$("$PYTHON" -c 'import importlib.util, pathlib; spec = importlib.util.find_spec("pytriton"); print(pathlib.Path(list(spec.submodule_search_locations)[0]) / "tritonserver")')"
site_packages="$(dirname "$(dirname "$root")")"
export LD_LIBRARY_PATH="$site_packages/nvidia_pytriton.libs:$site_packages/nvidia/cuda_runtime/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
exec "$root/bin/tritonserver" "--backend-directory=$root/backends" "$@"
