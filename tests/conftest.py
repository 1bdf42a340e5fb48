"""Shared fixtures: specs built the way users write them (camelCase YAML dicts)."""

from __future__ import annotations

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
