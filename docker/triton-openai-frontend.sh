#!/usr/bin/env bash
# Triton's own OpenAI frontend (server repo python/openai; NVIDIA's containers 24.11 and later) in place of
# tritonserver, for docker/entrypoint.sh: TRITONSERVER=/path/to/this. The entrypoint still renders the model
# configs and builds the TensorRT engines, then execs this with tritonserver's flags, of which only
# --model-repository is kept: the frontend runs Triton in process. docs/OPENAI.md has the whole recipe.
set -euo pipefail
repo=""
for arg in "$@"; do
  case "$arg" in --model-repository=*) repo="${arg#*=}" ;; esac
done
[[ -n "$repo" ]] || { echo "triton-openai-frontend: no --model-repository=... argument" >&2; exit 2; }
exec "${SPECDEC_PYTHON:-python3}" "${OPENAI_FRONTEND_MAIN:-/opt/tritonserver/python/openai/openai_frontend/main.py}" \
  --model-repository "$repo" --tokenizer "$repo/target_model/1" \
  --openai-port "${OPENAI_FRONTEND_PORT:-9000}" --host "${OPENAI_FRONTEND_HOST:-0.0.0.0}"
