"""Protobuf request bodies: `kubectl create secret|configmap|namespace|serviceaccount` send their objects as
`application/vnd.kubernetes.protobuf`, and the local API server stores what they say; a hand-encoded body checks
the metadata kubectl's generators do not send; other kinds are refused as protobuf, a broken body is a bad request."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")

from tests.devcluster.apiclient import Client

PROTOBUF = "application/vnd.kubernetes.protobuf"
SECRETS = "/api/v1/namespaces/default/secrets"


def test_kubectl_create_secret_generic_stores_its_literals_as_data(kubectl: Callable[..., str], api: Client) -> None:
    assert kubectl("create", "secret", "generic", "s", "--from-literal=key=value",
                   "--from-literal=spaced=a b") == "secret/s created"
    secret = api.get(f"{SECRETS}/s")
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == {"key": "value", "spaced": "a b"}
    assert secret["type"] == "Opaque" and secret["metadata"]["namespace"] == "default"
    assert kubectl("get", "secret", "s", "-o", "jsonpath={.data.key}") == base64.b64encode(b"value").decode()
    assert kubectl("get", "secret", "s").splitlines()[1].split()[:3] == ["s", "Opaque", "2"]


def test_kubectl_create_configmap_stores_literals_as_data_and_a_binary_file_as_binary_data(
        kubectl: Callable[..., str], api: Client, tmp_path: Path) -> None:
    blob = tmp_path / "blob"
    blob.write_bytes(bytes(range(256)))
    kubectl("create", "configmap", "c", "--from-literal=mode=fast", f"--from-file={blob}")
    configmap = api.get("/api/v1/namespaces/default/configmaps/c")
    assert configmap["data"] == {"mode": "fast"}
    assert base64.b64decode(configmap["binaryData"]["blob"]) == bytes(range(256))


def test_kubectl_create_namespace_and_serviceaccount(kubectl: Callable[..., str], api: Client) -> None:
    kubectl("create", "namespace", "team-a")
    assert api.get("/api/v1/namespaces/team-a")["status"]["phase"] == "Active"
    kubectl("create", "serviceaccount", "builder", "-n", "team-a")
    assert api.get("/api/v1/namespaces/team-a/serviceaccounts/builder")["metadata"]["namespace"] == "team-a"
    # (`default` came with the namespace, as the ServiceAccount controller makes it)
    assert kubectl("get", "serviceaccounts", "-n", "team-a", "-o", "name").split() == ["serviceaccount/builder",
                                                                                     "serviceaccount/default"]


def test_kubectl_create_of_a_kind_not_read_as_protobuf_says_to_send_json(kubectl: Callable[..., str]) -> None:
    error = kubectl("create", "deployment", "web", "--image=nginx", check=False)
    assert "reads for Secret, ConfigMap, Namespace, ServiceAccount only, not for apps/v1, Kind=Deployment" in error


# -- a body encoded by hand -----------------------------------------------------------------------------------------


def varint(number: int) -> bytes:
    out = bytearray()
    while True:
        low, number = number & 0x7F, number >> 7
        out.append(low | (0x80 if number else 0))
        if not number:
            return bytes(out)


def field(number: int, value: bytes | str | int) -> bytes:
    """One field: an int as a varint (wire type 0), bytes or a string length-delimited (wire type 2)."""
    if isinstance(value, int):
        return varint(number << 3) + varint(value)
    data = value.encode() if isinstance(value, str) else value
    return varint(number << 3 | 2) + varint(len(data)) + data


def entries(number: int, mapping: dict[str, str | bytes]) -> bytes:
    return b"".join(field(number, field(1, key) + field(2, value)) for key, value in mapping.items())


def envelope(kind: str, raw: bytes) -> bytes:
    return b"k8s\x00" + field(1, field(1, "v1") + field(2, kind)) + field(2, raw) + field(3, "") + field(4, "")


def post(api: Client, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(api.url + path, data=body, method="POST",
                                     headers={"Content-Type": PROTOBUF, "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_protobuf_secret_keeps_its_metadata_type_immutability_and_string_data(api: Client) -> None:
    owner = api.create("/api/v1/namespaces/default/configmaps", {"metadata": {"name": "owner"}})
    reference = (field(1, "ConfigMap") + field(3, "owner") + field(4, owner["metadata"]["uid"]) + field(5, "v1")
                 + field(6, 1))
    metadata = (field(1, "") + field(2, "token-") + field(3, "") + entries(11, {"app": "web", "tier": "db"})
                + entries(12, {"note": "from protobuf"}) + field(13, reference) + field(14, "example.com/keep")
                + field(7, 0) + field(8, b""))
    raw = (field(1, metadata) + entries(2, {"bin": b"\x00\xff"}) + field(3, "example.com/token")
           + entries(4, {"token": "s3cret"}) + field(5, 1) + field(99, "a field Kubernetes does not know either"))
    status, created = post(api, SECRETS, envelope("Secret", raw))
    assert status == 201, created
    stored = api.get(f"{SECRETS}/{created['metadata']['name']}")
    meta = stored["metadata"]
    assert meta["name"].startswith("token-") and len(meta["name"]) == len("token-") + 5
    assert (meta["labels"], meta["annotations"], meta["finalizers"]) == (
        {"app": "web", "tier": "db"}, {"note": "from protobuf"}, ["example.com/keep"])
    assert meta["ownerReferences"] == [{"kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"],
                                        "apiVersion": "v1", "controller": True}]
    assert stored["data"] == {"bin": "AP8=", "token": base64.b64encode(b"s3cret").decode()}
    assert (stored["type"], stored["immutable"], "stringData" in stored) == ("example.com/token", True, False)


def test_a_broken_or_misplaced_protobuf_body_is_a_bad_request(api: Client) -> None:
    configmap = envelope("ConfigMap", field(1, field(1, "c")) + entries(2, {"a": "b"}))
    status, answer = post(api, SECRETS, configmap)
    assert (status, answer["message"]) == (400, f"the body is a ConfigMap, which {SECRETS} does not serve")
    status, answer = post(api, SECRETS, configmap[:-9])  # cut inside the object
    assert status == 400 and "could not be decoded" in answer["message"]
    status, answer = post(api, SECRETS, b'{"metadata": {"name": "json"}}')
    assert status == 400 and "magic bytes" in answer["message"]
    assert api.names(SECRETS) == []
