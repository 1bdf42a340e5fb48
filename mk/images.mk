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

.PHONY: image image-cuda image-vllm

image:
	$(call kind_require,$(DOCKER),$(IMAGES_HINT))
	$(DOCKER) build -t '$(IMAGE_REPO):$(IMAGE_TAG)' .

image-cuda:
	$(call kind_require,$(DOCKER),$(IMAGES_HINT))
	$(DOCKER) build --build-arg TORCH_INDEX=https://pypi.org/simple --build-arg CUDA=1 -t '$(IMAGE_REPO):$(IMAGE_TAG)-cuda' .

image-vllm:
	$(call kind_require,$(DOCKER),$(IMAGES_HINT))
	$(DOCKER) build -f Dockerfile.vllm --build-arg VLLM_IMAGE='$(VLLM_BASE)' -t '$(VLLM_REPO):$(IMAGE_TAG)' .
