# specdec-triton: the two commands are `make serve` and `make test`.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
export HTTP_PORT GRPC_PORT METRICS_PORT

.PHONY: setup serve test test-unit test-integration lint configs check-configs

setup:
	@bash scripts/setup_env.sh

serve: setup
	@exec $(PY) -m specdec_client.server

test: setup
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
