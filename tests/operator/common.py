"""Helpers of the operator tests: manifests, waits on status, the pods, completions checked against the oracle."""

from __future__ import annotations

import base64
import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from shardwise.agents.auth import AgentAuth, auth_from_secret
from shardwise.devcluster.session import LocalSession

from tests.openai_shape import flat, greedy

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "tiny-moe.yaml").read_text())
READY_S = 240


@cache
def oracle(prompt: str, n: int) -> list[int]:
    from shardwise.agents.runtime.oracle import complete

    return list(complete("tiny-moe", 0, prompt, n)["token_ids"])


def local_session(factory: pytest.TempPathFactory, name: str, **options: Any) -> Iterator[LocalSession]:
    """A module's cluster and operator (2 nodes x 4 GPUs unless told otherwise), stopped at teardown."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    with LocalSession(factory.mktemp(name), **{"nodes": 2, "gpus_per_node": 4, **options}) as s:
        yield s


def manifest(name: str, *, eplb: dict[str, Any] | None = None, elastic: dict[str, Any] | None = None,
             autoscaling: dict[str, Any] | None = None, **parallelism: int | str) -> str:
    body = json.loads(json.dumps(EXAMPLE))
    body["metadata"]["name"] = name
    body["spec"]["parallelism"].update(parallelism)
    body["spec"]["eplb"].update(eplb or {})
    body["spec"]["elastic"].update(elastic or {})
    if autoscaling:
        body["spec"]["autoscaling"] = autoscaling
    return yaml.safe_dump(body)


def apply(s: LocalSession, text: str) -> None:
    s.kubectl("apply", "-f", "-", input=text)


def wait_status(s: LocalSession, name: str, check: Any, what: str, timeout: float = READY_S,
                namespace: str = "default") -> dict[str, Any]:
    def ready(obj: dict[str, Any]) -> dict[str, Any] | None:
        st = obj.get("status") or {}
        return st if check(st) else None

    try:  # on a watch of the deployment: every status it takes is seen, none polled for
        return s.wait_object("inferencedeployments.shardwise.io", name, ready, timeout, what,  # type: ignore[no-any-return]
                             namespace=namespace)
    except AssertionError:
        print(json.dumps(s.status(name, namespace), indent=1)[-3000:])
        print(s.operator_log.read_text()[-4000:])
        raise


def available(st: dict[str, Any]) -> bool:
    return st.get("phase") == "Running" and any(c["type"] == "Available" and c["status"] == "True"
                                                for c in st.get("conditions") or [])


def wait_available(s: LocalSession, name: str, *, world_above: int = 0, dpa: int | None = None) -> dict[str, Any]:
    return wait_status(s, name, lambda st: available(st) and int(st.get("worldGeneration") or 0) > world_above
                       and (dpa is None or st.get("dpa") == dpa), f"{name} Available")


def pods(s: LocalSession, name: str) -> list[dict[str, Any]]:
    """The deployment's worker pods that are not being deleted (its router pod aside)."""
    out = s.get("pods", namespace="default") or {}
    return [p for p in out.get("items", []) if p["metadata"].get("labels", {}).get("shardwise.io/deployment") == name
            and p["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
            and not p["metadata"].get("deletionTimestamp")]


def router_pod(s: LocalSession, name: str) -> dict[str, Any]:
    """The ready pod of the deployment's router Deployment (made by the local cluster's Deployment controller)."""
    out = s.get("pods", namespace="default") or {}
    routers = [p for p in out.get("items", []) if p["metadata"].get("labels", {}).get("shardwise.io/deployment") == name
               and p["metadata"]["labels"].get("app.kubernetes.io/component") == "router"
               and not p["metadata"].get("deletionTimestamp")
               and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or [])]
    assert len(routers) == 1, [p["metadata"]["name"] for p in routers]
    return routers[0]


def uids(s: LocalSession, name: str) -> dict[str, str]:
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(s, name)}


def post(url: str, body: dict[str, Any], timeout: float = 120, api_key: str = "") -> tuple[int, dict[str, Any]]:
    """A greedy completion; the answer reads as its first choice, or an error as its message (`flat`)."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(greedy(body)).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, flat(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        return e.code, flat(json.loads(e.read() or b"{}"))


def assert_serves_like_the_oracle(status: dict[str, Any], prompt: str = "The operator") -> None:
    """Every DPA group's pod, and the deployment's one URL (its router), answer like the oracle."""
    assert status["endpoints"] and status.get("url"), status
    for url in [*status["endpoints"], status["url"]]:
        code, body = post(url, {"prompt": prompt, "max_tokens": 8})
        assert code == 200 and body["token_ids"] == oracle(prompt, 8), (url, code, body)


def delete(s: LocalSession, name: str) -> None:
    s.kubectl("delete", "inferencedeployment", name, "--wait=true", timeout=120)
    s.wait_for(lambda: not pods(s, name), 60, f"the pods of {name} to go")


def events(s: LocalSession, name: str) -> list[dict[str, Any]]:
    return [e for e in (s.get("events") or {}).get("items", []) if e["involvedObject"]["name"] == name]


def token(s: LocalSession, name: str) -> str:
    secret = s.get("secret", f"{name}-agent-token")
    return base64.b64decode(secret["data"]["token"]).decode()


def agent_auth(s: LocalSession, name: str) -> AgentAuth:
    """What the operator dials the deployment's agents with: the token over mutual TLS (the pods take no other)."""
    return auth_from_secret(s.get("secret", f"{name}-agent-token")["data"])
