# The images, built with Docker (none is built by `make test`):
#
#   make image        shardwise:0.1.0        operator, router and reference runtime on the CPU build of torch
#   make image-cuda   shardwise:0.1.0-cuda   the same on torch's CUDA build, for worker pods on GPU nodes
#   make image-vllm   shardwise-vllm:0.1.0   vLLM's image with the shardwise agent, for engine vllm
#
# The tags are the defaults the API names (shardwise/api.py: DEFAULT_IMAGE, DEFAULT_VLLM_IMAGE; a test checks
# them against these). Override with make IMAGE_TAG=... or VLLM_BASE=vllm/vllm-openai:vX.Y.Z.

IMAGE_REPO ?= shardwise
IMAGE_TAG ?= 0.1.0
VLLM_REPO ?= shardwise-vllm
VLLM_BASE ?= vllm/vllm-openai:v0.32.0
IMAGES_HINT := building the images needs Docker (https://docs.docker.com/engine/install/)

.PHONY: image image-cuda image-vllm test-images docker-stop

image:
	$(call kind_require,$(DOCKER),$(IMAGES_HINT))
	mkdir -p build/wheels
	$(DOCKER) build -t '$(IMAGE_REPO):$(IMAGE_TAG)' .

image-cuda:
	$(call kind_require,$(DOCKER),$(IMAGES_HINT))
	mkdir -p build/wheels
	$(DOCKER) build --build-arg TORCH_INDEX=https://pypi.org/simple --build-arg CUDA=1 -t '$(IMAGE_REPO):$(IMAGE_TAG)-cuda' .

image-vllm:
	$(call kind_require,$(DOCKER),$(IMAGES_HINT))
	$(DOCKER) build -f Dockerfile.vllm --build-arg VLLM_IMAGE='$(VLLM_BASE)' -t '$(VLLM_REPO):$(IMAGE_TAG)' .

# The image tier: the CPU image built from the Dockerfile and run by Docker (tests/images: its agent as the image's
# non-root user on a mounted transformers checkpoint, its operator against the local cluster). Docker and debootstrap
# are installed when missing and the daemon started (mk/docker-ready.sh, as root); where the Dockerfile's base
# cannot be pulled it is made offline (mk/offline-base.sh: debootstrap's Debian bookworm and its Python 3.11); the
# machine's own torch wheel, where pip has it locally, is staged in build/wheels so that no torch index is needed.
# Builds run on the host's network, as the containers of the tests do: every address is this machine's loopback.
test-images: install
	mk/docker-ready.sh
	mk/offline-base.sh
	mkdir -p build/wheels
	$(BIN)/pip download --quiet --no-deps --dest build/wheels 'torch==2.13.0+cpu' >/dev/null 2>&1 || \
	  echo "no local torch wheel: the image takes torch from its TORCH_INDEX"
	$(DOCKER) build --network host $$(ls build/wheels/torch-2.13.0*.whl >/dev/null 2>&1 && \
	  echo --build-arg TORCH_INDEX=https://pypi.org/simple) -t '$(IMAGE_REPO):$(IMAGE_TAG)' .
	$(BIN)/pytest -q tests/images

# Stops a Docker daemon mk/docker-ready.sh started (by its pid; one started otherwise is left alone).
docker-stop:
	@if [ -f build/dockerd.pid ]; then kill "$$(cat build/dockerd.pid)" 2>/dev/null || true; \
	  for _ in $$(seq 1 30); do kill -0 "$$(cat build/dockerd.pid)" 2>/dev/null || break; sleep 1; done; \
	  rm -f build/dockerd.pid; echo "dockerd stopped"; fi
