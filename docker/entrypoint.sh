#!/usr/bin/env bash
# specdec-triton container entrypoint (GPU image docker/Dockerfile and CPU image docker/Dockerfile.cpu).
#
# 1. Model repository. With SPECDEC_DEPLOYMENT naming a deployment YAML (runtime per model, instance counts,
#    KIND_GPU and `gpus` placement: the schema of build/deployments/*.yaml), serve a writable copy of the
#    baked repository (a tree of symlinks: no weights are copied) whose config.pbtxt files are rendered from
#    that YAML by build/render_configs.py. Without it, serve the baked repository as it is.
# 2. TensorRT engines. When the deployment uses the tensorrt runtime (or SPECDEC_BUILD_ENGINES=1), build them
#    at first start for the GPU this container runs on, with build/build_engines.py, into
#    $SPECDEC_ENGINE_CACHE/<gpu>-sm<capability>-trt<version>-<hash of deployment and model files>/. A lock
#    serialises replicas sharing a cache volume, a marker file tells a finished build from an interrupted
#    one, and a later start on the same GPU type reuses it. The models find it in $SPECDEC_ENGINE_DIR.
# 3. exec tritonserver (it becomes the container's main process and gets SIGTERM itself: it drains in-flight
#    requests for --exit-timeout-secs) with safe defaults: --model-control-mode=none (no load/unload API),
#    strict readiness. Arguments given to the container are appended.
#
# Environment: SPECDEC_HOME (/opt/specdec), SPECDEC_MODEL_REPOSITORY, SPECDEC_DEPLOYMENT (the base deployment YAML),
# SPECDEC_DEPLOYMENT_OVERRIDES (a YAML merged over it key by key), SPECDEC_RUN_REPOSITORY,
# SPECDEC_BUILD_ENGINES (auto|1|0), SPECDEC_ENGINE_CACHE, SPECDEC_BUILD_ENGINES_ARGS, SPECDEC_EXIT_TIMEOUT_S,
# HTTP_PORT, GRPC_PORT, METRICS_PORT, TRITONSERVER (the server command), SPECDEC_PYTHON,
# SPECDEC_OPENAI_PORT / SPECDEC_OPENAI_HOST (the OpenAI-compatible endpoint; unset or 0: not started).
set -euo pipefail

log() { printf '[specdec-entrypoint] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 2; }

APP="${SPECDEC_HOME:-/opt/specdec}"
PYTHON="${SPECDEC_PYTHON:-python3}"
SOURCE_REPO="${SPECDEC_MODEL_REPOSITORY:-$APP/model_repository}"
DEPLOYMENT="${SPECDEC_DEPLOYMENT:-}"
RUN_REPO="${SPECDEC_RUN_REPOSITORY:-${TMPDIR:-/tmp}/specdec/model_repository}"
ENGINE_CACHE="${SPECDEC_ENGINE_CACHE:-/var/cache/specdec/engines}"
BUILD_ENGINES="${SPECDEC_BUILD_ENGINES:-auto}"
TRITONSERVER="${TRITONSERVER:-tritonserver}"

[[ -d "$SOURCE_REPO" ]] || die "no model repository at $SOURCE_REPO"
repo="$SOURCE_REPO"

# --- 1. model repository --------------------------------------------------------------------------------------
if [[ -n "${SPECDEC_DEPLOYMENT_OVERRIDES:-}" ]]; then
  # Overrides (the Helm chart's `deployment:` value) merged key by key over the base deployment YAML, so a
  # chart only states what it changes (placement, runtime) and every other key keeps the image's default.
  [[ -n "$DEPLOYMENT" && -f "$DEPLOYMENT" ]] || die "SPECDEC_DEPLOYMENT_OVERRIDES needs a base SPECDEC_DEPLOYMENT file"
  [[ -f "$SPECDEC_DEPLOYMENT_OVERRIDES" ]] || die "SPECDEC_DEPLOYMENT_OVERRIDES=$SPECDEC_DEPLOYMENT_OVERRIDES: no such file"
  merged="$(dirname "$RUN_REPO")/deployment.yaml"
  mkdir -p "$(dirname "$merged")"
  "$PYTHON" - "$DEPLOYMENT" "$SPECDEC_DEPLOYMENT_OVERRIDES" "$merged" <<'PY'
import sys
import yaml


def merge(base, over):
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: merge(base[k], v) if k in base else v for k, v in over.items()}}
    return over


with open(sys.argv[1]) as f:
    base = yaml.safe_load(f) or {}
with open(sys.argv[2]) as f:
    over = yaml.safe_load(f) or {}
with open(sys.argv[3], "w") as f:
    yaml.safe_dump(merge(base, over), f, sort_keys=False)
PY
  log "deployment: $SPECDEC_DEPLOYMENT_OVERRIDES merged over $DEPLOYMENT into $merged"
  DEPLOYMENT="$merged"
fi

if [[ -n "$DEPLOYMENT" ]]; then
  [[ -f "$DEPLOYMENT" ]] || die "SPECDEC_DEPLOYMENT=$DEPLOYMENT: no such file"
  source_abs="$(cd "$SOURCE_REPO" && pwd -P)"
  rm -rf "$RUN_REPO"
  mkdir -p "$(dirname "$RUN_REPO")"
  cp -rs "$source_abs" "$RUN_REPO"
  # The renderer must write new files, never through a link into the baked repository.
  find "$RUN_REPO" -mindepth 2 -maxdepth 2 -name config.pbtxt -type l -delete
  "$PYTHON" "$APP/build/render_configs.py" "$DEPLOYMENT" --out "$RUN_REPO" >&2
  for model_dir in "$RUN_REPO"/*/; do  # a model the deployment does not describe keeps its own config
    name="$(basename "$model_dir")"
    if [[ ! -e "$model_dir/config.pbtxt" && -e "$source_abs/$name/config.pbtxt" ]]; then
      cp "$source_abs/$name/config.pbtxt" "$model_dir/config.pbtxt"
    fi
  done
  repo="$RUN_REPO"
  log "model repository: $repo (configs rendered from $DEPLOYMENT)"
fi

# --- 2. TensorRT engines ----------------------------------------------------------------------------------------
uses_tensorrt() {
  [[ -n "$DEPLOYMENT" ]] || return 1
  "$PYTHON" - "$DEPLOYMENT" <<'PY'
import sys
import yaml
with open(sys.argv[1]) as f:
    dep = yaml.safe_load(f) or {}
default = dep.get("runtime", "torch")
runtimes = {default} | {m.get("runtime", default) for m in (dep.get("models") or {}).values() if isinstance(m, dict)}
sys.exit(0 if "tensorrt" in runtimes else 1)
PY
}

engine_fingerprint() {
  local gpus trt models
  command -v nvidia-smi >/dev/null 2>&1 || die "the tensorrt runtime needs a GPU: nvidia-smi is not on PATH"
  # The GPUs this container sees (NVIDIA_VISIBLE_DEVICES / the device plugin): one type per pod is assumed.
  gpus="$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader | sort -u | head -n 1 || true)"
  [[ -n "$gpus" ]] || die "the tensorrt runtime needs a GPU and nvidia-smi sees none"
  trt="$("$PYTHON" -c 'import tensorrt; print(tensorrt.__version__)')"
  models="$( (cat "$DEPLOYMENT"; cd "$SOURCE_REPO" && find -L . -type f \
      \( -name '*.safetensors' -o -name '*.bin' -o -name '*.onnx' -o -name 'config.json' \) -printf '%p %s %T@\n' \
      | LC_ALL=C sort) | sha256sum | cut -c1-12)"
  printf '%s-sm%s-trt%s-%s' "$(printf '%s' "${gpus%%,*}" | tr -cs 'A-Za-z0-9' '-' | sed 's/-*$//')" \
    "$(printf '%s' "${gpus##*,}" | tr -d ' .')" "$trt" "$models"
}

build_engines() {
  local fp dir partial
  fp="$(engine_fingerprint)"
  dir="$ENGINE_CACHE/$fp"
  mkdir -p "$ENGINE_CACHE"
  exec 9>"$ENGINE_CACHE/.build.lock"
  log "engines: waiting for the build lock ($ENGINE_CACHE/.build.lock)"
  flock 9
  if [[ -f "$dir/.complete" ]]; then
    log "engines: reusing $dir"
  else
    [[ -f "$APP/build/build_engines.py" ]] || die "the tensorrt runtime needs $APP/build/build_engines.py"
    partial="$dir.partial.$$"
    rm -rf "$partial"
    log "engines: building for $fp into $dir (first start on this GPU type: minutes)"
    # shellcheck disable=SC2086  # SPECDEC_BUILD_ENGINES_ARGS is a list of extra flags
    "$PYTHON" "$APP/build/build_engines.py" --deployment "$DEPLOYMENT" --model-repository "$repo" \
      --output-dir "$partial" ${SPECDEC_BUILD_ENGINES_ARGS:-} >&2
    date -u +%Y-%m-%dT%H:%M:%SZ > "$partial/.complete"
    rm -rf "$dir"
    mv "$partial" "$dir"
    log "engines: built $dir"
  fi
  flock -u 9
  exec 9>&-
  export SPECDEC_ENGINE_DIR="$dir"
}

case "$BUILD_ENGINES" in
  1) build_engines ;;
  auto) if uses_tensorrt; then build_engines; fi ;;
  0) ;;
  *) die "SPECDEC_BUILD_ENGINES must be auto, 1 or 0, not $BUILD_ENGINES" ;;
esac

# --- 3. tritonserver ------------------------------------------------------------------------------------------
args=(
  "--model-repository=$repo"
  --model-control-mode=none
  --strict-readiness=true
  "--http-port=${HTTP_PORT:-8000}"
  "--grpc-port=${GRPC_PORT:-8001}"
  "--metrics-port=${METRICS_PORT:-8002}"
  "--exit-timeout-secs=${SPECDEC_EXIT_TIMEOUT_S:-30}"
)
if ! nvidia-smi -L >/dev/null 2>&1; then
  # No GPU: no GPU metrics, no pinned host memory (both would only log warnings).
  args+=(--allow-gpu-metrics=false --pinned-memory-pool-byte-size=0)
fi
# tritonserver 2.51 parses HTTP JSON recursively on its threads' stacks: a ~200 KB body of nested brackets
# overflows the usual 8 MiB (docs/SECURITY.md). A larger stack limit is inherited by its threads.
ulimit -s "${SPECDEC_STACK_KIB:-65536}" 2>/dev/null || log "could not raise the stack limit; cap request bodies in front"
# --- 4. the OpenAI-compatible endpoint (docs/OPENAI.md) -----------------------------------------------------------
# In the background, restarted if it exits; it answers 503 until tritonserver is ready. After the exec below it
# is a child of tritonserver (this pid), and goes with the container when tritonserver exits.
if [[ -n "${SPECDEC_OPENAI_PORT:-}" && "${SPECDEC_OPENAI_PORT}" != "0" ]]; then
  openai_cmd=("$PYTHON" -m specdec_client.openai_api --triton-url "127.0.0.1:${GRPC_PORT:-8001}"
              --host "${SPECDEC_OPENAI_HOST:-0.0.0.0}" --port "$SPECDEC_OPENAI_PORT" --tokenizer "$repo/target_model/1")
  log "OpenAI-compatible endpoint on port $SPECDEC_OPENAI_PORT: ${openai_cmd[*]}"
  ( while true; do "${openai_cmd[@]}" || true; sleep 2; done ) </dev/null >&2 &
fi

log "exec $TRITONSERVER ${args[*]} $*"
exec "$TRITONSERVER" "${args[@]}" "$@"
