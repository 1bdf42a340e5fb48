"""The generated CRD (`shardwise crd`) passes what an API server checks before it serves a CRD, as the local API
server checks it: no field apiextensions v1 lacks (strict decoding refuses the whole CRD for one, e.g.
`propertyNames`), and every rule and messageExpression in a form the CEL cost guard knows to pass (a real server
refuses e.g. `'a=' + string(self.a)` as over its cost budget)."""

from __future__ import annotations

import copy

import pytest

from shardwise import crd

pytest.importorskip("celpy")
from shardwise.devcluster import celcost


def test_every_rule_and_message_expression_of_the_generated_crd_is_a_form_known_to_pass() -> None:
    generated = crd.crd()
    assert len(list(celcost.expressions(generated))) >= 3
    assert [(r.path, r.reason) for r in celcost.refusals(generated)] == []


def test_the_guard_would_refuse_the_generated_crd_with_a_message_expression_formatting_an_integer() -> None:
    generated = copy.deepcopy(crd.crd())
    spec = generated["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["x-kubernetes-validations"][1]["messageExpression"] = "'dpa=' + string(self.parallelism.dpa)"
    assert [r.path for r in celcost.refusals(generated)] == [
        "spec.validation.openAPIV3Schema.properties[spec].x-kubernetes-validations[1].messageExpression"]


def test_the_generated_crd_has_no_field_apiextensions_v1_lacks() -> None:
    pytest.importorskip("kubernetes")
    from shardwise.devcluster import decoding

    assert decoding.decode("CustomResourceDefinition", crd.crd()).unknown == []
    schema = copy.deepcopy(crd.crd())
    schema["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["propertyNames"] = {"maxLength": 3}
    assert decoding.decode("CustomResourceDefinition", schema).unknown == [
        "spec.versions[0].schema.openAPIV3Schema.propertyNames"]
