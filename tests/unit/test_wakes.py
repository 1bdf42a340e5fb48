"""Which cached changes wake a deployment's reconcile step (operator/handlers.woken_by): its own new generation
or deletion, any change of its pods, an owned object deleted; never its own status writes."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("kopf")

from shardwise.operator.handlers import woken_by


def obj(kind: str, generation: int = 1, owner: str = "llm", deleting: bool = False, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "llm" if kind == "InferenceDeployment" else "llm-0", "namespace": "team",
                            "generation": generation, "labels": {"shardwise.io/deployment": owner}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-04T00:00:00Z"
    return {"kind": kind, "metadata": meta, **extra}


ID = "InferenceDeployment"


@pytest.mark.parametrize(("kind", "old", "new", "woken"), [
    (ID, None, obj(ID), ("team", "llm")),
    (ID, obj(ID), obj(ID, status={"phase": "Running"}), None),  # its own status write
    (ID, obj(ID), obj(ID, generation=2), ("team", "llm")),  # a spec change
    (ID, obj(ID), obj(ID, deleting=True), ("team", "llm")),
    (ID, obj(ID), None, ("team", "llm")),
    ("Pod", None, obj("Pod"), ("team", "llm")),
    ("Pod", obj("Pod"), obj("Pod", status={"phase": "Running"}), ("team", "llm")),
    ("Pod", obj("Pod"), None, ("team", "llm")),
    ("Pod", None, obj("Pod", owner=""), None),  # not one of a deployment's
    ("ConfigMap", obj("ConfigMap"), obj("ConfigMap", data={"plan.json": "{}"}), None),  # its own write
    ("ConfigMap", obj("ConfigMap"), None, ("team", "llm")),  # deleted by hand: made again
    ("Service", obj("Service"), None, ("team", "llm")),
], ids=["deployment created", "status written", "spec changed", "deployment deleting", "deployment gone",
        "pod created", "pod running", "pod deleted", "a pod of no deployment", "configmap patched",
        "configmap deleted", "service deleted"])
def test_a_cached_change_wakes_the_step_it_concerns(kind: str, old: Any, new: Any, woken: Any) -> None:
    assert woken_by(kind, old, new) == woken


def test_a_step_failed_for_want_of_the_api_server_is_one_line_and_anything_else_a_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    from shardwise.operator.handlers import failed
    from shardwise.operator.kube import KubeError

    failed("reconcile of team/llm", KubeError(0, "the API server did not answer GET /x: Connection refused"))
    failed("reconcile of team/llm", KubeError(503, "Service Unavailable"))
    failed("reconcile of team/llm", KubeError(422, "Unprocessable Entity"))
    failed("reconcile of team/llm", ValueError("a bug"))
    logged = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert logged == [
        ("WARNING", "reconcile of team/llm failed: the API server did not answer GET /x: Connection refused; "
                    "retrying", False),
        ("WARNING", "reconcile of team/llm failed: 503 Service Unavailable; retrying", False),
        ("ERROR", "reconcile of team/llm failed", True),
        ("ERROR", "reconcile of team/llm failed", True),
    ]
