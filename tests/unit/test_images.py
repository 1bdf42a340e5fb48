"""The images a user builds (`make image`, `image-cuda`, `image-vllm`) carry the tags the API defaults to, so a
deployment that names no image runs what the make targets built. (Building needs Docker: not done here.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from shardwise.api import DEFAULT_IMAGE, DEFAULT_VLLM_IMAGE

ROOT = Path(__file__).resolve().parents[2]


def build_command(target: str) -> str:
    out = subprocess.run(["make", "-s", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    return next(line for line in out.splitlines() if " build " in line)


def tag(command: str) -> str:
    found = re.search(r"-t '([^']+)'", command)
    assert found, command
    return found.group(1)


def test_the_default_images_of_the_api_are_the_ones_the_make_targets_build() -> None:
    assert tag(build_command("image")) == DEFAULT_IMAGE
    assert tag(build_command("image-vllm")) == DEFAULT_VLLM_IMAGE
    assert tag(build_command("image-cuda")) == f"{DEFAULT_IMAGE}-cuda"


def test_the_cuda_image_asks_for_a_cuda_build_of_torch_and_checks_it_got_one() -> None:
    command = build_command("image-cuda")
    assert "TORCH_INDEX=https://pypi.org/simple" in command and "CUDA=1" in command
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'pip install --index-url "$TORCH_INDEX" torch==2.13.0' in dockerfile
    assert "assert bool(torch.version.cuda) == bool($CUDA)" in dockerfile


def test_the_vllm_image_keeps_vllms_torch_and_installs_the_agents_other_dependencies() -> None:
    dockerfile = (ROOT / "Dockerfile.vllm").read_text()
    assert "FROM ${VLLM_IMAGE}" in dockerfile and "if not r.startswith('torch')" in dockerfile
    assert "VLLM_IMAGE='vllm/vllm-openai:" in build_command("image-vllm")
    for part in ("shardwise", "operator", "controllers", "agents", "devcluster"):
        assert f"COPY {part} ./{part}" in dockerfile and (ROOT / part).is_dir()
