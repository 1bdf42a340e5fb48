# One image for the operator (`shardwise operator`) and the worker pods' node agent (`shardwise agent`), with
# the reference runtime on the CPU build of torch (`make image`), or on the CUDA build for GPU nodes
# (`make image-cuda`: TORCH_INDEX=https://pypi.org/simple, whose Linux wheels of torch bundle CUDA).
#
#   docker build -t shardwise:0.1.0 .
#   docker build --build-arg TORCH_INDEX=https://pypi.org/simple --build-arg CUDA=1 -t shardwise:0.1.0-cuda .
#
# Two stages: the first installs the project and its dependencies into a virtual environment, the second
# copies only that environment, so the image holds no source tree, build tools or pip cache.

FROM python:3.11-slim AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/shardwise
ENV PATH=/opt/shardwise/bin:$PATH

# torch first, from one index alone (the CPU wheels by default: with PyPI in the same resolution a CUDA build
# could be chosen). Its own layer, so that a change to the sources does not download torch again. A wheel of it in
# build/wheels/ (an offline build, `make test-images`, puts the machine's own there) is taken instead of the index.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG CUDA=0
COPY build/wheels/ /wheels/
RUN if ls /wheels/torch-2.13.0*.whl >/dev/null 2>&1; then pip install --find-links /wheels 'torch==2.13.0+cpu'; \
    else pip install --index-url "$TORCH_INDEX" torch==2.13.0; fi

WORKDIR /src
COPY pyproject.toml README.md ./
COPY shardwise ./shardwise
COPY operator ./operator
COPY controllers ./controllers
COPY agents ./agents
COPY devcluster ./devcluster
# A regular (not editable) install: the packages land in site-packages, so /src can be left behind. The CPU
# index stays an extra index so that the torch==2.13.0 of the runtime extra resolves to the wheel above. The
# check runs from / because /src/operator would shadow the standard library's `operator`.
RUN pip install --extra-index-url "$TORCH_INDEX" '.[runtime,operator]' \
 && cd / && python -c "import torch; assert bool(torch.version.cuda) == bool($CUDA), \
      f'CUDA={$CUDA} but torch {torch.__version__} has CUDA {torch.version.cuda}'" \
 && shardwise --version


FROM python:3.11-slim

ENV PATH=/opt/shardwise/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/shardwise

# A fixed numeric user, so that Kubernetes can check runAsNonRoot without a passwd lookup (the chart's
# podSecurityContext uses the same 10001).
RUN groupadd --system --gid 10001 shardwise \
 && useradd --system --uid 10001 --gid 10001 --home-dir /home/shardwise --create-home --shell /usr/sbin/nologin shardwise

COPY --from=build /opt/shardwise /opt/shardwise

USER 10001:10001
# Not the source tree: a top-level `operator/` folder in the working directory would shadow the stdlib's.
WORKDIR /home/shardwise

EXPOSE 8000 8080 9090 9443 50051
ENTRYPOINT ["shardwise"]
CMD ["--help"]
