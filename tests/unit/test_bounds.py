"""Bounds on what the operator plans and stores: the largest world it plans (with the numbers when a spec asks for
more, now or at maxDpa) and a plan ConfigMap that stays under the API server's object limit at that size."""

from __future__ import annotations

from typing import Any

from shardwise.operator import builders as b

from shardwise.api import InferenceDeploymentSpec
from shardwise.planner import MAX_WORLD_SIZE, plan

OWNER: dict[str, Any] = {"apiVersion": "shardwise.io/v1alpha1", "kind": "InferenceDeployment",
                         "metadata": {"name": "big", "namespace": "ml", "uid": "u-1"}}


def llama(dpa: int, max_dpa: int | None = None) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({
        "model": {"preset": "Llama-3.1-405B"}, "hardware": {"gpu": "H200", "gpusPerNode": 8},
        "parallelism": {"tp": 8, "dpa": dpa}, "elastic": {"maxDpa": max_dpa or dpa}})


def test_the_largest_world_plans_and_its_configmap_fits_the_object_limit() -> None:
    p = plan(llama(MAX_WORLD_SIZE // 8))
    assert p.valid and p.world_size == MAX_WORLD_SIZE, p.errors
    cm = b.build_configmap(OWNER, p)
    assert len(cm["data"][b.PLAN_KEY].encode()) < 1_000_000  # the API server refuses objects over 1 MiB


def test_a_world_beyond_the_cap_is_refused_with_its_numbers() -> None:
    p = plan(llama(200_000))
    assert not p.valid and [(v.field, v.message) for v in p.errors] == [(
        "spec.parallelism", "pp*dpa*cp*tp = 1*200000*1*8 = 1,600,000 ranks; the operator plans at most 2,048")]
    assert p.grid is None  # nothing of that size was built


def test_a_max_dpa_beyond_the_cap_is_a_warning_with_where_dpa_stops() -> None:
    p = plan(llama(2, 1_000))
    assert p.valid
    assert [(v.field, v.message) for v in p.warnings if v.field == "spec.elastic.maxDpa"] == [(
        "spec.elastic.maxDpa", "maxDpa=1000 would grow the world to pp*maxDpa*cp*tp = 8,000 ranks; the operator "
        "plans at most 2,048, so dpa stops at 256")]
