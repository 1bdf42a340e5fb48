"""The CRD's CEL rules say what the planner says: each spec of the table is refused by a rule (evaluated by
cel-python, as the API server would) exactly when the planner refuses it on the same field. The rules' messages are
static (a real API server refuses messageExpressions that format integers as over its CEL cost budget); the
admission webhook gives the numbers."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from shardwise.planner import plan
from tests.conftest import make_spec
from tests.devcluster.apiclient import CRD_FILE

pytest.importorskip("celpy")
from shardwise.devcluster.validation import rules_of, violations

RULES = rules_of(yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
TINY = {"model": {"preset": "tiny-moe"}, "hardware": {"gpu": "cpu", "gpusPerNode": 8}}


@pytest.mark.parametrize(("spec", "field", "numbers"), [
    ({}, None, None),
    ({"parallelism": {"dpa": 4}, "elastic": {"maxDpa": 4}}, None, None),
    ({"parallelism": {"dpa": 5}, "elastic": {"maxDpa": 4}}, "spec.parallelism.dpa", "must lie within"),
    ({"parallelism": {"dpa": 1}, "elastic": {"minDpa": 2, "maxDpa": 4}}, "spec.parallelism.dpa", "must lie within"),
    ({"parallelism": {"dpa": 65}}, "spec.parallelism.dpa", "must lie within"),  # the default maxDpa
    ({"elastic": {"minDpa": 5, "maxDpa": 4}, "parallelism": {"dpa": 4}}, "spec.elastic.minDpa", "must not exceed"),
    ({"parallelism": {"tp": 8, "dpa": 512}, "elastic": {"maxDpa": 512}}, "spec.parallelism", "at most 2048 ranks"),
    ({"parallelism": {"tp": 4, "dpa": 512}, "elastic": {"maxDpa": 512}}, None, None),
])
def test_a_rule_refuses_what_the_planner_refuses_on_the_same_field(
        spec: dict[str, Any], field: str | None, numbers: str | None) -> None:
    broken = violations(RULES, {"spec": {**TINY, **spec}})
    planned = plan(make_spec(**spec) if "elastic" in spec else make_spec(**spec, elastic={"maxDpa": 64}))
    planner_fields = {e.field for e in planned.errors}
    if field is None:
        assert broken == [], broken
        assert not planner_fields & {"spec.parallelism", "spec.parallelism.dpa", "spec.elastic.minDpa"}
    else:
        assert len(broken) == 1 and broken[0].startswith(f"{field}: Invalid value"), broken
        assert numbers is not None and numbers in broken[0]
        assert field in planner_fields, planned.errors


def test_every_rule_compiles_and_names_a_field_and_a_message() -> None:
    assert len(RULES) >= 3
    for r in RULES:
        assert r.path == ("spec",) and r.field_path.startswith(".") and r.message and not r.message_expression
    assert violations(RULES, {"spec": TINY}) == []  # (a rule that does not compile would be reported here)


def test_an_overflowing_size_is_refused_not_wrapped() -> None:
    broken = violations(RULES, {"spec": {**TINY, "parallelism": {"tp": 2**62, "dpa": 4, "pp": 2**62}}})
    assert any(b.startswith("spec.parallelism: Invalid value") for b in broken), broken


def _strings(node: Any, path: str = "spec") -> list[tuple[str, dict[str, Any]]]:
    if not isinstance(node, dict):
        return []
    found = [(path, node)] if node.get("type") == "string" else []
    for name, child in (node.get("properties") or {}).items():
        found += _strings(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        found += _strings(node.get(key), f"{path}[]")
    return found


def test_every_string_a_user_writes_is_bounded_in_the_crd_as_pydantic_bounds_it() -> None:
    from pydantic import ValidationError

    from shardwise.api import MAX_STRING, InferenceDeploymentSpec

    schema = yaml.safe_load(CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    strings = _strings(schema["properties"]["spec"])
    assert len(strings) > 20
    assert [p for p, s in strings if "maxLength" not in s and "enum" not in s] == []
    assert {s["maxLength"] for p, s in strings if p == "spec.hardware.resourceName"} == {MAX_STRING}
    with pytest.raises(ValidationError, match=r"hardware\.resourceName"):
        InferenceDeploymentSpec.model_validate({**TINY, "hardware": {"resourceName": "x" * (MAX_STRING + 1)}})
    # a field with its own bound keeps it: an environment variable's value may be 32 KiB
    env = [{"name": "BIG", "value": "v" * 32768}]
    assert InferenceDeploymentSpec.model_validate({**TINY, "runtime": {"env": env}}).runtime.env[0].value
