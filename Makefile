# shardwise — every command a developer or CI needs. `make demo` and `make test` are the quick start.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint typecheck crds check-crds bench bench-plan bench-eplb clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev,runtime]'
	touch $(STAMP)

demo: install
	$(BIN)/python -m shardwise.demo

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check shardwise operator controllers agents devcluster tests bench
	$(BIN)/mypy -p shardwise

crds: install
	$(BIN)/shardwise crd > crds/inferencedeployments.shardwise.io.yaml
	cp crds/inferencedeployments.shardwise.io.yaml charts/shardwise/crds/

bench: bench-plan

bench-plan: install
	$(BIN)/python bench/bench_plan.py

bench-eplb: install
	$(BIN)/python bench/bench_eplb.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis
