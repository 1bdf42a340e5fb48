"""Field ownership and server-side apply as pure functions (devcluster/fields.py): field sets in the FieldsV1 form,
the merge of an applied configuration, removal of what an applier leaves out, conflicts, and the ownership an
ordinary write takes."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("kmock")

from shardwise.devcluster import fields
from shardwise.devcluster.fields import APPLY, UPDATE, Conflicts, Manager
from shardwise.devcluster.patches import merge_keys_of

POD_KEYS = merge_keys_of("Pod", builtin=True)
CR_KEYS = merge_keys_of("InferenceDeployment", builtin=False)


def applier(name: str, time: str = "2025-01-01T00:00:00Z") -> Manager:
    return Manager(name, APPLY, "v1", time=time)


def writer(name: str) -> Manager:
    return Manager(name, UPDATE, "v1", time="2025-01-01T00:00:00Z")


def cm(**data: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "default"},
            "data": data}


def pod(*containers: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": list(containers),
                                                                                   **spec}}


def owners(managers: list[Manager]) -> dict[str, set[str]]:
    return {m.manager: {fields.path_string(path) for path in m.fields} for m in managers}


def test_a_field_set_reads_as_fieldsv1_without_server_owned_metadata_and_decodes_back() -> None:
    obj = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "uid": "u", "resourceVersion": "3", "labels": {"app": "x"},
                        "finalizers": ["a/b"]},
           "spec": {"containers": [{"name": "main", "image": "i", "env": [{"name": "E", "value": "1"}]}],
                    "tolerations": [{"key": "k"}], "volumes": []}}
    tree = fields.to_fields_v1(fields.field_set(obj, POD_KEYS))
    assert tree == {
        "f:metadata": {"f:finalizers": {'v:"a/b"': {}}, "f:labels": {"f:app": {}}},
        "f:spec": {
            "f:containers": {'k:{"name":"main"}': {".": {}, "f:env": {'k:{"name":"E"}': {
                ".": {}, "f:name": {}, "f:value": {}}}, "f:image": {}, "f:name": {}}},
            "f:tolerations": {},  # not keyed: owned whole
            "f:volumes": {},
        },
    }
    assert fields.from_fields_v1(tree) == fields.field_set(obj, POD_KEYS)


@pytest.mark.parametrize(("path", "text"), [
    (("f:data", "f:a"), ".data.a"),
    (("f:spec", "f:containers", 'k:{"name":"main"}', "f:image"), '.spec.containers[name="main"].image'),
    (("f:metadata", "f:finalizers", 'v:"x"'), '.metadata.finalizers[="x"]'),
])
def test_paths_print_as_kubernetes_prints_them_in_conflicts(path: tuple[str, ...], text: str) -> None:
    assert fields.path_string(path) == text


def test_apply_merges_maps_and_keyed_lists_item_by_item_and_takes_other_lists_whole() -> None:
    live = pod({"name": "main", "image": "a", "env": [{"name": "X", "value": "1"}]},
               {"name": "side", "image": "s"}, tolerations=[{"key": "a"}, {"key": "b"}])
    config = {"spec": {"containers": [{"name": "main", "env": [{"name": "Y", "value": "2"}]}],
                       "tolerations": [{"key": "c"}]}}
    merged, _ = fields.apply(live, config, [], applier("a"), POD_KEYS, force=False)
    assert merged["spec"]["containers"] == [
        {"name": "main", "image": "a", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]},
        {"name": "side", "image": "s"}]
    assert merged["spec"]["tolerations"] == [{"key": "c"}]


def test_a_custom_resource_takes_its_lists_whole() -> None:
    live = {"spec": {"endpoints": [{"name": "a"}, {"name": "b"}]}}
    merged, _ = fields.apply(live, {"spec": {"endpoints": [{"name": "c"}]}}, [], applier("a"), CR_KEYS, force=False)
    assert merged["spec"]["endpoints"] == [{"name": "c"}]


def test_what_an_applier_leaves_out_goes_unless_another_manager_owns_it() -> None:
    obj, managers = fields.apply({}, cm(a="1", b="2", c="3"), [], applier("a"), {}, force=False)
    obj, managers = fields.apply(obj, cm(c="3"), managers, applier("b"), {}, force=False)  # b shares c
    obj, managers = fields.apply(obj, cm(a="1"), managers, applier("a"), {}, force=False)
    assert obj["data"] == {"a": "1", "c": "3"}
    assert owners(managers) == {"a": {".data.a"}, "b": {".data.c"}}


def test_a_map_left_empty_by_a_removal_goes_with_it() -> None:
    config = {**cm(), "metadata": {"name": "c", "labels": {"x": "1"}}}
    obj, managers = fields.apply({}, config, [], applier("a"), {}, force=False)
    obj, _ = fields.apply(obj, cm(a="1"), managers, applier("a"), {}, force=False)
    assert "labels" not in obj["metadata"]


def test_setting_a_field_another_manager_owns_to_another_value_is_a_conflict_naming_manager_and_field() -> None:
    obj, managers = fields.apply({}, cm(a="1", b="2"), [], applier("a"), {}, force=False)
    with pytest.raises(Conflicts) as caught:
        fields.apply(obj, cm(a="9", b="8"), managers, applier("b"), {}, force=False)
    assert caught.value.message == 'Apply failed with 2 conflicts: conflicts with "a":\n- .data.a\n- .data.b'
    assert caught.value.causes()[0] == {"type": "FieldManagerConflict", "message": 'conflict with "a"',
                                        "field": ".data.a"}


def test_the_same_value_is_shared_ownership_and_forcing_takes_the_field_away() -> None:
    obj, managers = fields.apply({}, cm(a="1", b="2"), [], applier("a"), {}, force=False)
    obj, managers = fields.apply(obj, cm(a="1"), managers, applier("b"), {}, force=False)
    assert owners(managers) == {"a": {".data.a", ".data.b"}, "b": {".data.a"}}
    obj, managers = fields.apply(obj, cm(b="7"), managers, applier("b"), force=True, merge_keys={})
    assert obj["data"] == {"a": "1", "b": "7"}  # a still owns a, which b no longer applies
    assert owners(managers) == {"a": {".data.a"}, "b": {".data.b"}}


def test_a_conflict_with_an_ordinary_writer_names_its_api_version() -> None:
    managers = fields.update({}, cm(a="1"), [], writer("kubectl-edit"), {})
    with pytest.raises(Conflicts, match=r'conflict with "kubectl-edit" using v1: \.data\.a'):
        fields.apply(cm(a="1"), cm(a="2"), managers, applier("a"), {}, force=False)


def test_containers_conflict_on_their_fields_not_on_the_list_and_an_omitted_container_goes_whole() -> None:
    obj, managers = fields.apply({}, pod({"name": "main", "image": "a"}), [], applier("a"), POD_KEYS, force=False)
    obj, managers = fields.apply(obj, pod({"name": "side", "image": "s"}), managers, applier("b"), POD_KEYS,
                                 force=False)
    assert [c["name"] for c in obj["spec"]["containers"]] == ["main", "side"]
    with pytest.raises(Conflicts, match=r'\.spec\.containers\[name="main"\]\.image'):
        fields.apply(obj, pod({"name": "main", "image": "b"}), managers, applier("b"), POD_KEYS, force=False)
    forced, _ = fields.apply(obj, pod({"name": "main", "image": "b"}), managers, applier("b"), POD_KEYS, force=True)
    assert forced["spec"]["containers"] == [{"name": "main", "image": "b"}]  # b's side container went whole


def test_an_ordinary_write_takes_what_it_changes_from_the_other_managers() -> None:
    obj, managers = fields.apply({}, cm(a="1", b="2"), [], applier("a"), {}, force=False)
    managers = fields.update(obj, cm(a="5", b="2", c="3"), managers, writer("kubectl-patch"), {})
    assert owners(managers) == {"a": {".data.b"}, "kubectl-patch": {".data.a", ".data.c"}}


def test_a_repeated_apply_that_changes_nothing_keeps_the_entry_as_it_was() -> None:
    obj, managers = fields.apply({}, cm(a="1"), [], applier("a", "2025-01-01T00:00:00Z"), {}, force=False)
    again, after = fields.apply(obj, cm(a="1"), managers, applier("a", "2025-06-01T00:00:00Z"), {}, force=False)
    assert again == obj
    assert after == managers


@pytest.mark.parametrize(("sent", "expect"), [
    pytest.param(None, {"a"}, id="no managedFields in the write: the stored ones, updated"),
    pytest.param([], {"a"}, id="an empty list changes nothing"),
    pytest.param([{}], None, id="a single empty entry clears them"),
])
def test_a_write_keeps_clears_or_replaces_the_stored_managed_fields(sent: Any, expect: set[str] | None) -> None:
    stored = fields.with_managers(cm(a="1"), fields.update({}, cm(a="1"), [], writer("a"), {}))
    new = cm(a="2")
    if sent is not None:
        new["metadata"]["managedFields"] = sent
    result = fields.tracked(stored, new, writer("a"), {})
    if expect is None:
        assert "managedFields" not in result["metadata"]
    else:
        assert {entry["manager"] for entry in result["metadata"]["managedFields"]} == expect


def test_malformed_managed_fields_are_refused() -> None:
    new = cm(a="1")
    new["metadata"]["managedFields"] = [{"manager": "x", "operation": "Rewrite"}]
    with pytest.raises(fields.ManagedFieldsError):
        fields.tracked(None, new, writer("a"), {})
