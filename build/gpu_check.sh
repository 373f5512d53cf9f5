#!/usr/bin/env bash
# The prepared GPU check (docs/TENSORRT.md): one script, under 10 minutes on one H200, printing figures.
#
#   bash build/gpu_check.sh                # results in $OUT (the device machine's folder) or bench_results/gpu_check
#
# Steps (each under its own timeout; a missing piece is reported and skipped, never faked):
#   1. env         GPU, torch / CUDA, tensorrt, onnx, tritonserver wheel
#   2. torch-cuda  committed pair on the torch runtime on CUDA: parity with CPU, greedy speculation == plain,
#                  per-step costs and c                                               (needs torch with CUDA)
#   3. tensorrt    fp32 + fp16 engines of the committed pair; parity with torch on CUDA; per-step costs and c
#                  of torch vs TensorRT, interleaved                          (needs the tensorrt package too)
#   4. pytest      tests/unit/test_tensorrt_build.py, whose engine tests run only here
#   5. server      tritonserver end to end, torch on KIND_GPU, then tensorrt  (needs the nvidia-pytriton wheel)
# Python: $PYTHON, else .venv/bin/python, else python3.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT_DIR="${OUT:-bench_results/gpu_check}"
mkdir -p "$OUT_DIR"
exec > >(tee -a "$OUT_DIR/gpu_check.log") 2>&1

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/python_backend:$PWD/client${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
started=$SECONDS
status=0

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "=== [$((SECONDS - started)) s] $name (timeout ${limit} s)"
  timeout "$limit" "$@"
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    echo "=== $name FAILED (exit $rc)"
    status=1
  fi
  return $rc
}

has() { "$PY" -c "$1" >/dev/null 2>&1; }

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv
else
  echo "nvidia-smi: not on PATH"
fi
step env 60 "$PY" build/gpu_check.py env --out "$OUT_DIR"

if has 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  step torch-cuda 240 "$PY" build/gpu_check.py torch-cuda --out "$OUT_DIR"
  if has 'import tensorrt'; then
    step tensorrt 210 "$PY" build/gpu_check.py tensorrt --out "$OUT_DIR"
    if has 'import pytest'; then  # its engine tests need tensorrt; the rest run in the CPU suite
      step pytest 60 "$PY" -m pytest -q -rs -p no:cacheprovider tests/unit/test_tensorrt_build.py
    fi
  else
    echo "=== tensorrt SKIPPED: the tensorrt package does not import ($PY)"
  fi
  if has 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("pytriton") else 1)'; then
    step server-torch 200 "$PY" build/gpu_check.py server --runtime torch --out "$OUT_DIR"
    if [[ -f "$OUT_DIR/engines/fp16/target_model/model.plan" ]]; then
      step server-tensorrt 200 "$PY" build/gpu_check.py server --runtime tensorrt \
        --engine-dir "$OUT_DIR/engines/fp16" --out "$OUT_DIR"
    fi
  else
    echo "=== server SKIPPED: no tritonserver (nvidia-pytriton wheel) in $PY"
  fi
else
  echo "=== torch-cuda, tensorrt, server SKIPPED: torch sees no CUDA GPU ($PY)"
  status=1
fi
echo "=== done in $((SECONDS - started)) s, status $status; figures: $OUT_DIR/gpu_check.json"
exit $status
