"""Shared fixtures: specs built the way users write them (camelCase YAML dicts)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from shardwise.api import InferenceDeploymentSpec


def make_spec(**sections: Any) -> InferenceDeploymentSpec:
    """A spec from camelCase sections, e.g. make_spec(model={"preset": "tiny-moe"}, parallelism={"tp": 2})."""
    body: dict[str, Any] = {"model": {"preset": "tiny-moe"}, "hardware": {"gpu": "cpu", "gpusPerNode": 8}}
    for key, value in sections.items():
        body[key] = value if key == "model" else {**body.get(key, {}), **value}
    body.setdefault("elastic", {"maxDpa": 1024})
    return InferenceDeploymentSpec.model_validate(body)


@pytest.fixture
def spec_factory() -> Any:
    return make_spec


def shardwise_command() -> list[str]:
    """The installed `shardwise` console script (never `python -m` from the repo root: see the Makefile)."""
    script = Path(sys.executable).parent / "shardwise"
    found = str(script) if script.exists() else shutil.which("shardwise")
    assert found, "the shardwise console script is not installed: run `make install`"
    return [found]
