# A real Kubernetes cluster in Docker (kind) for tests/e2e_kind: the image built from this repository, the chart
# installed by the tests, worker pods scheduled on nodes that advertise nvidia.com/gpu (nothing uses a GPU: the
# example runs the CPU reference runtime; the resource only lets the pods' requests be scheduled).
#
#   make kind-up      create the cluster `shardwise` when missing; nvidia.com/gpu: 2 on every node
#   make kind-load    docker build -t shardwise:0.1.0 . and load it into the cluster's nodes
#   make e2e-kind     kind-up, kind-load, then the tests in tests/e2e_kind
#   make kind-down    delete the cluster
#
# Included by the Makefile; the tools are looked up on PATH and can be overridden (make KIND=... DOCKER=...).

KIND ?= kind
DOCKER ?= docker
KUBECTL ?= kubectl
KIND_CLUSTER ?= shardwise
KIND_CONFIG ?= tests/e2e_kind/kind-cluster.yaml
KIND_IMAGE ?= shardwise:0.1.0
KIND_GPUS ?= 2
KIND_PYTEST ?= .venv/bin/pytest
KIND_CONTEXT := kind-$(KIND_CLUSTER)

# $(call kind_require,TOOL,HINT): stop with one line naming what is missing and where to get it.
kind_require = @command -v $(1) >/dev/null 2>&1 || { echo "error: '$(1)' is not on PATH: $(2)" >&2; exit 1; }
KIND_HINT_DOCKER := the kind targets need Docker (https://docs.docker.com/engine/install/)
KIND_HINT_KIND := install kind (https://kind.sigs.k8s.io/docs/user/quick-start/)
KIND_HINT_KUBECTL := install kubectl (https://kubernetes.io/docs/tasks/tools/)

.PHONY: kind-tools kind-up kind-load e2e-kind kind-down

kind-tools:
	$(call kind_require,$(DOCKER),$(KIND_HINT_DOCKER))
	$(call kind_require,$(KIND),$(KIND_HINT_KIND))
	@$(DOCKER) info >/dev/null 2>&1 || { echo "error: the Docker daemon does not answer ('$(DOCKER) info' failed): start it" >&2; exit 1; }

# Extended resources are advertised by patching the node status (what a device plugin would report). The
# kubelet zeroes them when it re-registers (e.g. after a Docker restart), so this runs on every kind-up.
kind-up: kind-tools
	$(call kind_require,$(KUBECTL),$(KIND_HINT_KUBECTL))
	@if $(KIND) get clusters 2>/dev/null | grep -qx '$(KIND_CLUSTER)'; then \
	  echo "kind cluster '$(KIND_CLUSTER)' exists"; \
	else \
	  $(KIND) create cluster --name '$(KIND_CLUSTER)' --config '$(KIND_CONFIG)' --wait 180s; \
	fi
	@for node in $$($(KUBECTL) --context '$(KIND_CONTEXT)' get nodes -o name); do \
	  $(KUBECTL) --context '$(KIND_CONTEXT)' patch "$$node" --subresource=status --type=merge \
	    -p '{"status":{"capacity":{"nvidia.com/gpu":"$(KIND_GPUS)"},"allocatable":{"nvidia.com/gpu":"$(KIND_GPUS)"}}}' \
	    >/dev/null || exit 1; \
	  echo "$$node: nvidia.com/gpu=$(KIND_GPUS)"; \
	done

kind-load: kind-tools
	$(DOCKER) build -t '$(KIND_IMAGE)' .
	$(KIND) load docker-image '$(KIND_IMAGE)' --name '$(KIND_CLUSTER)'

e2e-kind: kind-up kind-load
	@test -x '$(KIND_PYTEST)' || { echo "error: $(KIND_PYTEST) is missing: run 'make install' first" >&2; exit 1; }
	SHARDWISE_KIND_CLUSTER='$(KIND_CLUSTER)' SHARDWISE_E2E_IMAGE='$(KIND_IMAGE)' '$(KIND_PYTEST)' -q tests/e2e_kind

kind-down:
	$(call kind_require,$(KIND),$(KIND_HINT_KIND))
	$(KIND) delete cluster --name '$(KIND_CLUSTER)'
