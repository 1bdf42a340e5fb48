"""kubectl's default validation against the local API server: `kubectl apply` and `kubectl create` ask the server's
OpenAPI v3 documents whether it validates fields itself, and fail with "failed to download openapi" where no
document answers. These run kubectl as a user types it: no --validate=false."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import yaml

from tests.devcluster.apiclient import Client

ROOT = Path(__file__).resolve().parents[2]


def test_the_readmes_kubectl_apply_works_with_kubectls_default_validation(api: Client, kubectl: Callable[..., str],
                                                                          tmp_path: Path) -> None:
    assert "created" in kubectl("apply", "-f", str(ROOT / "crds"))
    assert kubectl("apply", "-f", str(ROOT / "examples" / "tiny-moe.yaml")) == \
        "inferencedeployment.shardwise.io/tiny-moe created"
    changed = yaml.safe_load((ROOT / "examples" / "tiny-moe.yaml").read_text())
    changed["spec"]["parallelism"]["dpa"] = 1
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(changed))
    assert kubectl("apply", "-f", str(tmp_path / "one.yaml")) == "inferencedeployment.shardwise.io/tiny-moe configured"
    stored = json.loads(kubectl("get", "inferencedeployment", "tiny-moe", "-o", "json"))
    assert stored["spec"]["parallelism"]["dpa"] == 1
    assert kubectl("create", "namespace", "team-a") == "namespace/team-a created"


def test_every_served_group_version_has_a_document_whose_patch_takes_field_validation(api: Client) -> None:
    index = api.get("/openapi/v3")["paths"]
    assert {"api/v1", "apis/apps/v1", "apis/apiextensions.k8s.io/v1"} <= set(index)
    for gv, entry in index.items():
        doc = api.get(entry["serverRelativeURL"].split("?")[0])
        patches = [item["patch"] for item in doc["paths"].values() if "patch" in item]
        assert patches, gv
        for op in patches:
            assert "fieldValidation" in {p["name"] for p in op["parameters"]}, (gv, op["operationId"])
            assert op["x-kubernetes-group-version-kind"]["version"]
    assert api.call("GET", "/openapi/v3/apis/nothing.example/v1")[0] == 404
