"""The API as users write it: camelCase YAML, sane defaults, every example in examples/ valid."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shardwise.api import InferenceDeployment, InferenceDeploymentSpec, ScaleDownMode
from shardwise.planner import plan

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_a_spec_with_only_a_model_gets_sane_defaults() -> None:
    spec = InferenceDeploymentSpec.model_validate({"model": {"preset": "tiny-moe"}})
    assert (spec.parallelism.tp, spec.parallelism.dpa, spec.parallelism.pp, spec.parallelism.cp) == (1, 1, 1, 1)
    assert spec.hardware.resource_name == "nvidia.com/gpu"
    assert spec.elastic.scale_down.mode is ScaleDownMode.DRAIN
    assert spec.parallelism.ep_size == 1
    assert 0 < spec.serving.memory_fraction <= 1


def test_ep_defaults_to_every_rank_of_a_stage() -> None:
    spec = InferenceDeploymentSpec.model_validate(
        {"model": {"preset": "tiny-moe"}, "parallelism": {"tp": 2, "dpa": 3, "pp": 2, "moeTp": 2}})
    assert spec.parallelism.ep_size == 3


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_is_a_valid_deployment(path: Path) -> None:
    dep = InferenceDeployment.model_validate(yaml.safe_load(path.read_text()))
    p = plan(dep.spec)
    assert p.valid, [str(e) for e in p.errors]


def test_specs_round_trip_through_their_camel_case_form() -> None:
    spec = InferenceDeploymentSpec.model_validate(
        {"model": {"preset": "tiny-moe"}, "elastic": {"scaleDown": {"mode": "abort", "drainTimeoutSeconds": 5}}})
    again = InferenceDeploymentSpec.model_validate(spec.model_dump(by_alias=True, mode="json"))
    assert again == spec
    assert spec.model_dump(by_alias=True)["elastic"]["scaleDown"]["drainTimeoutSeconds"] == 5
