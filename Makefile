# shardwise — every command a developer or CI needs. `make demo` and `make test` are the quick start.
# Never `python -m ...` or `python -c` from the repository root: the top-level `operator/` folder would
# shadow the standard library's `operator` in a fresh interpreter. Console scripts are safe.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint typecheck crds check-crds bench bench-plan bench-eplb clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,runtime]'
	touch $(STAMP)

demo: install
	$(BIN)/shardwise demo

test: install
	$(BIN)/pytest -q

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
