"""The committed CRD is exactly what the API types generate, and Kubernetes would accept its schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardwise.crd import crd, render

ROOT = Path(__file__).resolve().parents[2]
CRD_FILE = ROOT / "crds" / "inferencedeployments.shardwise.io.yaml"


def test_the_committed_crd_is_fresh() -> None:
    assert CRD_FILE.read_text() == render(), "crds/ is stale: run `make crds`"


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    if isinstance(node, dict):
        out.append((path, node))
        for key, value in node.get("properties", {}).items():
            out += _walk(value, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            out += _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_the_schema_is_structural() -> None:
    schema = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def keys(node: Any) -> set[str]:  # every key of every mapping in the schema (descriptions are values)
        if isinstance(node, dict):
            return set(node) | {k for v in node.values() for k in keys(v)}
        return {k for v in node for k in keys(v)} if isinstance(node, list) else set()

    assert not keys(schema) & {"$ref", "anyOf", "allOf", "oneOf", "$defs", "const"}
    for path, node in _walk(schema):
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
        assert node.get("additionalProperties") is not False, f"{path}: additionalProperties false"
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True


def test_every_spec_field_has_a_description() -> None:
    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    missing = [p for p, n in _walk(spec)[1:] if "description" not in n and not p.endswith(("[]", "{}"))]
    assert not missing


def test_scale_subresource_drives_dpa_and_columns_show_desired_and_serving_dpa_model_and_reason() -> None:
    version = crd()["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.parallelism.dpa",
        "statusReplicasPath": ".status.dpa",
        "labelSelectorPath": ".status.selector",
    }
    columns = version["additionalPrinterColumns"]
    assert [c["name"] for c in columns if not c.get("priority")] == ["Phase", "Desired", "DPA", "Ready", "Model",
                                                                      "Reason", "Age"]
    assert [c["name"] for c in columns if c.get("priority") == 1] == ["World", "Engine", "URL"]  # `-o wide`
    paths = {c["name"]: c["jsonPath"] for c in columns}
    assert paths["Desired"] == ".spec.parallelism.dpa" and paths["DPA"] == ".status.dpa"
    assert paths["Reason"] == '.status.conditions[?(@.type=="Available")].reason'
    conditions = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert "type" in conditions["items"]["required"]  # a map list's key must be required
    names = crd()["spec"]["names"]
    assert names["shortNames"] == ["idep"] and names["kind"] == "InferenceDeployment"


def test_spec_defaults_in_the_schema_match_the_models() -> None:
    par = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"][
        "parallelism"]["properties"]
    assert par["tp"]["default"] == 1 and par["tp"]["minimum"] == 1
    assert par["cpMode"]["enum"] == ["pcp", "dcp"]
    assert par["ep"].get("nullable") is True


def test_the_chart_carries_an_exact_copy_of_the_crd() -> None:
    chart_copy = ROOT / "charts" / "shardwise" / "crds" / CRD_FILE.name
    assert chart_copy.read_bytes() == CRD_FILE.read_bytes(), "the chart's CRD is stale: run `make crds`"


def status_keys_written() -> dict[str, str]:
    """Every top-level status key the operator writes, read from its source: `st["key"] = ...` in the reconcile
    step and the elastic state machine, and the keys of `{"status": {...}}` patches and `_patch_status` calls
    (the EPLB and autoscaler daemons). Key -> where it is written first."""
    import ast

    found: dict[str, str] = {}
    for path in sorted((ROOT / "operator").glob("*.py")):
        if path.name == "webhook.py":
            continue  # its "status" is an AdmissionReview's answer, not the deployment's
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            keys: list[ast.expr] = []
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "st":
                keys = [node.slice]
            elif isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values, strict=True):
                    if isinstance(k, ast.Constant) and k.value == "status" and isinstance(v, ast.Dict):
                        keys += [x for x in v.keys if x is not None]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "_patch_status" and len(node.args) > 2:
                keys = [node.args[2]]
            for k in keys:
                if isinstance(k, ast.Constant) and isinstance(k.value, str):
                    found.setdefault(k.value, f"{path.relative_to(ROOT)}:{k.lineno}")
    return found


def test_every_status_key_the_operator_writes_is_a_typed_field_of_the_status() -> None:
    from shardwise.api import InferenceDeploymentStatus

    written = status_keys_written()
    assert {"phase", "elastic", "gang", "worldHash", "spares", "eplb", "autoscaling"} <= set(written)  # it reads them
    fields = {f.alias or name for name, f in InferenceDeploymentStatus.model_fields.items()}
    missing = {k: at for k, at in written.items() if k not in fields}
    assert not missing, f"status keys without a field in InferenceDeploymentStatus (then `make crds`): {missing}"
