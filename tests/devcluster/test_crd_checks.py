"""What the local API server checks of a CustomResourceDefinition before it serves it, as a real one does: strict
decoding (a field apiextensions v1 does not have is an unknown field, refused or dropped as the write's
`fieldValidation` says, refused by server-side apply) and the CEL cost guard on its rules and messageExpressions."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kmock")
pytest.importorskip("kubernetes")  # the models strict decoding reads its fields from

from tests.devcluster.apiclient import APPLY, CRDS, MERGE, Client

NAME = "widgets.example.com"
WIDGETS = "/apis/example.com/v1/namespaces/default/widgets"
COST = ("Forbidden: estimated {what} cost exceeds budget by factor of more than 100x (try simplifying the {what}, "
        "or adding maxItems, maxProperties, and maxLength where arrays, maps, and strings are declared)")


def crd(spec: dict[str, Any], *, versions: tuple[str, ...] = ("v1",)) -> dict[str, Any]:
    """A CRD of Widgets whose every version's schema has this `spec` node."""
    schema = {"type": "object", "properties": {"spec": spec}}
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": NAME},
            "spec": {"group": "example.com", "scope": "Namespaced",
                     "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
                     "versions": [{"name": v, "served": True, "storage": v == versions[0],
                                   "schema": {"openAPIV3Schema": copy.deepcopy(schema)}} for v in versions]}}


def with_selector(extra: dict[str, Any]) -> dict[str, Any]:
    """A spec with a string map `selector` whose schema also has `extra`."""
    return {"type": "object", "properties": {"selector": {"type": "object", "additionalProperties": {"type": "string"},
                                                          **extra}}}


def send(api: Client, method: str, path: str, body: Any, *, content_type: str = "application/json",
         **params: str) -> tuple[int, dict[str, Any], str | None]:
    """(status, answer, Warning header) of one request."""
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(api.url + path + query, data=data, method=method,
                                     headers={"Content-Type": content_type, "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read()), response.headers.get("Warning")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers.get("Warning")


PATH = "spec.versions[0].schema.openAPIV3Schema.properties.spec.properties.selector.propertyNames"


# -- strict decoding ------------------------------------------------------------------------------------------------


def test_a_strict_create_with_a_keyword_jsonschemaprops_lacks_is_refused_naming_its_full_path(api: Client) -> None:
    status, answer, _ = send(api, "POST", CRDS, crd(with_selector({"propertyNames": {"maxLength": 63}})),
                             fieldValidation="Strict")
    assert (status, answer["reason"]) == (400, "BadRequest")
    assert answer["message"] == ('CustomResourceDefinition in version "v1" cannot be handled as a '
                                 f'CustomResourceDefinition: strict decoding error: unknown field "{PATH}"')
    assert api.call("GET", f"{CRDS}/{NAME}")[0] == 404


def test_every_unknown_field_is_named_in_order_inside_rules_items_and_later_versions_too(api: Client) -> None:
    spec = {"type": "object", "x-kubernetes-validations": [{"rule": "true", "mesage": "typo"}],
            "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLenght": 3}}}}
    body = crd(spec, versions=("v1", "v2"))
    body["spec"]["versions"][1]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["tags"]["uniqe"] = 1
    status, answer, _ = send(api, "POST", CRDS, body, fieldValidation="Strict")
    assert status == 400
    assert answer["message"].split("strict decoding error: ")[1] == ", ".join(f'unknown field "{p}"' for p in (
        "spec.versions[0].schema.openAPIV3Schema.properties.spec.x-kubernetes-validations[0].mesage",
        "spec.versions[0].schema.openAPIV3Schema.properties.spec.properties.tags.items.maxLenght",
        "spec.versions[1].schema.openAPIV3Schema.properties.spec.x-kubernetes-validations[0].mesage",
        "spec.versions[1].schema.openAPIV3Schema.properties.spec.properties.tags.items.maxLenght",
        "spec.versions[1].schema.openAPIV3Schema.properties.spec.properties.tags.uniqe"))


def test_every_field_of_jsonschemaprops_and_of_a_validation_rule_is_accepted(api: Client) -> None:
    spec = {"type": "object", "description": "d", "nullable": True, "default": {"anything": ["goes", 1]},
            "example": {"free": True}, "externalDocs": {"description": "docs", "url": "https://example.com"},
            "x-kubernetes-preserve-unknown-fields": True, "minProperties": 0, "maxProperties": 9,
            "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "m", "messageExpression": "'m'",
                                          "reason": "FieldValueForbidden", "fieldPath": ".a",
                                          "optionalOldSelf": True}],
            "properties": {"a": {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"},
                                                                                {"type": "string"}]},
                           "l": {"type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["k"],
                                 "items": {"type": "object", "required": ["k"],
                                           "properties": {"k": {"type": "string", "pattern": "^a", "minLength": 1,
                                                                "maxLength": 5, "format": "byte"}}}},
                           "m": {"type": "object", "x-kubernetes-map-type": "granular",
                                 "additionalProperties": {"type": "number", "minimum": 0, "maximum": 1,
                                                          "exclusiveMinimum": True, "multipleOf": 0.5}},
                           "e": {"type": "string", "enum": ["x"], "not": {"pattern": "y"}}}}
    status, answer, warning = send(api, "POST", CRDS, crd(spec), fieldValidation="Strict")
    assert (status, warning) == (201, None), answer
    assert api.get(f"{CRDS}/{NAME}")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"] == spec


def test_without_strict_the_unknown_field_is_dropped_warn_saying_so_and_ignore_silently(
        start: Callable[..., Client]) -> None:
    for directive, warned in ((None, True), ("Warn", True), ("Ignore", False)):
        api = start()
        params = {"fieldValidation": directive} if directive else {}
        status, _, warning = send(api, "POST", CRDS, crd(with_selector({"propertyNames": {"maxLength": 3}})),
                                  **params)
        assert status == 201
        assert warning == (f'299 - "unknown field \\"{PATH}\\""' if warned else None)
        stored = api.get(f"{CRDS}/{NAME}")["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        assert stored["properties"]["spec"]["properties"]["selector"] == {
            "type": "object", "additionalProperties": {"type": "string"}}
        api.create(WIDGETS, {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})


def test_a_strict_update_or_patch_adding_an_unknown_field_is_refused_and_changes_nothing(api: Client) -> None:
    created = api.create(CRDS, crd(with_selector({})))
    replaced = crd(with_selector({"propertyNames": {"maxLength": 3}}))
    replaced["metadata"]["resourceVersion"] = created["metadata"]["resourceVersion"]
    status, answer, _ = send(api, "PUT", f"{CRDS}/{NAME}", replaced, fieldValidation="Strict")
    assert status == 400 and answer["message"].endswith(f'unknown field "{PATH}"')
    patch = {"spec": {"versions": crd(with_selector({"propertyNames": {}}))["spec"]["versions"]}}
    status, answer, _ = send(api, "PATCH", f"{CRDS}/{NAME}", patch, content_type=MERGE, fieldValidation="Strict")
    assert status == 400 and answer["message"].endswith(f'unknown field "{PATH}"')
    assert api.get(f"{CRDS}/{NAME}")["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]


def test_an_unsupported_field_validation_directive_is_invalid(api: Client) -> None:
    status, answer, _ = send(api, "POST", CRDS, crd(with_selector({})), fieldValidation="strict")
    assert status == 422
    assert answer["message"] == ('CreateOptions.meta.k8s.io "" is invalid: fieldValidation: Unsupported value: '
                                 '"strict": supported values: "", "Ignore", "Strict", "Warn"')


@pytest.mark.parametrize("directive", ["Ignore", "Strict"])
def test_server_side_apply_refuses_an_unknown_field_whatever_the_directive(api: Client, directive: str) -> None:
    body = yaml.safe_dump(crd(with_selector({"propertyNames": {"maxLength": 3}}))).encode()
    status, answer, _ = send(api, "PATCH", f"{CRDS}/{NAME}", body, content_type=APPLY, fieldManager="me",
                             fieldValidation=directive)
    assert status == 500
    assert answer["message"] == (f"failed to create typed patch object (/{NAME}; apiextensions.k8s.io/v1, "
                                 f"Kind=CustomResourceDefinition): .{PATH}: field not declared in schema")
    assert api.call("GET", f"{CRDS}/{NAME}")[0] == 404


def test_kubectl_apply_server_side_of_a_crd_with_an_unknown_field_fails_with_the_field(
        kubectl: Callable[..., str], tmp_path: Path) -> None:
    manifest = tmp_path / "crd.yaml"
    manifest.write_text(yaml.safe_dump(crd(with_selector({"propertyNames": {"maxLength": 3}}))))
    error = kubectl("apply", "--server-side", "--validate=false", "-f", str(manifest), check=False)
    assert f".{PATH}: field not declared in schema" in error
    assert "NotFound" in kubectl("get", "crd", NAME, check=False)
    manifest.write_text(yaml.safe_dump(crd(with_selector({}))))
    kubectl("apply", "--server-side", "--validate=false", "-f", str(manifest))
    assert kubectl("get", "crd", NAME, "-o", "name") == f"customresourcedefinition.apiextensions.k8s.io/{NAME}"


# -- the CEL cost guard -------------------------------------------------------------------------------------------


def rules(*validations: dict[str, str], **properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "x-kubernetes-validations": list(validations), "properties": properties}


def refusal(where: str, what: str) -> str:
    return f"spec.validation.openAPIV3Schema.properties[spec]{where}.{what}: {COST.format(what=what)}"


def test_a_message_expression_formatting_an_integer_is_refused_as_over_the_cost_budget(api: Client) -> None:
    spec = rules({"rule": "self.a <= 4", "messageExpression": "'a=' + string(self.a)"}, a={"type": "integer"})
    status, answer = api.call("POST", CRDS, crd(spec))
    assert (status, answer["reason"]) == (422, "Invalid")
    assert answer["message"] == (f'customresourcedefinitions.apiextensions.k8s.io "{NAME}" is invalid: '
                                 + refusal(".x-kubernetes-validations[0]", "messageExpression"))
    assert api.call("GET", f"{CRDS}/{NAME}")[0] == 404
    spec["x-kubernetes-validations"][0] = {"rule": "self.a <= 4", "message": "a must be at most 4"}
    api.create(CRDS, crd(spec))  # a static message passes
    status, answer = api.call("POST", WIDGETS, {"apiVersion": "example.com/v1", "kind": "Widget",
                                                "metadata": {"name": "w"}, "spec": {"a": 5}})
    assert (status, answer["message"].split(": ")[-1]) == (422, "a must be at most 4")


UNBOUNDED = {"type": "array", "items": {"type": "string"}}
BOUNDED = {"type": "array", "maxItems": 8, "items": {"type": "string", "maxLength": 16}}


@pytest.mark.parametrize(("rule", "tags", "passes"), [
    ("self.tags.all(t, t != '')", UNBOUNDED, False),
    ("self.tags.all(t, t != '')", BOUNDED, True),
    ("'x' in self.tags", UNBOUNDED, False),
    ("self.tags.exists(t, t.startsWith('a'))", {**UNBOUNDED, "maxItems": 8}, False),  # its strings are unbounded
    ("self.tags.exists(t, t.startsWith('a'))", BOUNDED, True),
    ("size(self.name) <= 10", UNBOUNDED, False),
    ("self.name.matches('^a')", UNBOUNDED, False),
    ("self.short.contains('a') && size(self.short) < 5", UNBOUNDED, True),
    ("string(self.count) == '1'", UNBOUNDED, False),
    ("self.short + 'x' == oldSelf.short + 'x'", UNBOUNDED, True),
])
def test_iterations_and_string_functions_over_unbounded_values_are_refused_and_bounded_ones_pass(
        api: Client, rule: str, tags: dict[str, Any], passes: bool) -> None:
    spec = rules({"rule": rule}, tags=tags, name={"type": "string"}, short={"type": "string", "maxLength": 5},
                 count={"type": "integer"})
    status, answer = api.call("POST", CRDS, crd(spec))
    if passes:
        assert status == 201, answer
    else:
        assert (status, answer["message"].split(" is invalid: ")[1]) == (
            422, refusal(".x-kubernetes-validations[0]", "rule"))


def test_rules_under_items_and_of_versions_with_different_schemas_are_named_by_their_own_paths(api: Client) -> None:
    nested = rules(tags={"type": "array", "maxItems": 4, "items": {
        "type": "string", "x-kubernetes-validations": [{"rule": "size(self) > 0"}]}})
    status, answer = api.call("POST", CRDS, crd(nested))
    assert status == 422
    assert answer["message"].split(" is invalid: ")[1] == refusal(
        ".properties[tags].items.x-kubernetes-validations[0]", "rule")
    two = crd(rules({"rule": "true"}), versions=("v1", "v2"))
    two["spec"]["versions"][1]["schema"]["openAPIV3Schema"]["properties"]["spec"] = rules(
        {"rule": "true", "messageExpression": "string(self.n)"}, n={"type": "integer"})
    status, answer = api.call("POST", CRDS, two)
    assert status == 422
    assert answer["message"].split(" is invalid: ")[1] == (
        "spec.versions[1].schema.openAPIV3Schema.properties[spec].x-kubernetes-validations[0].messageExpression: "
        + COST.format(what="messageExpression"))


def test_a_crd_stored_with_an_expensive_rule_keeps_it_through_updates_but_gets_no_new_one(
        start: Callable[..., Client]) -> None:
    from shardwise.devcluster.apiserver import APIServer

    with APIServer() as held:  # a snapshot that holds the CRD with a rule the guard refuses (stored before it was)
        Client(held.url).create(CRDS, crd(rules({"rule": "true"}, a={"type": "integer"})))
        snapshot = held.snapshot()
    entry = next(e for e in snapshot["objects"] if e["object"]["metadata"]["name"] == NAME)
    expensive = {"rule": "self.a <= 4", "messageExpression": "'a=' + string(self.a)"}
    entry["object"]["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "x-kubernetes-validations"] = [expensive]
    api = start(restore=snapshot)
    api.patch(f"{CRDS}/{NAME}", {"metadata": {"labels": {"team": "a"}}})
    versions = api.get(f"{CRDS}/{NAME}")["spec"]["versions"]
    versions[0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"].append(
        {"rule": "self.a >= 0", "messageExpression": "string(self.a) + ' is negative'"})
    status, answer = api.call("PATCH", f"{CRDS}/{NAME}", {"spec": {"versions": versions}}, content_type=MERGE)
    assert status == 422
    assert answer["message"].split(" is invalid: ")[1] == refusal(".x-kubernetes-validations[1]",
                                                                  "messageExpression")
