"""A failed operator test deletes the deployments it left, so that their pods do not hold the module cluster's
GPUs and fail the tests after it for want of room (one failure, not a cascade); first it prints what they
show (status, events, the operator log's tail, each of their pods' log tail: agents, routers, vLLM) for the failed
test's report, which CI's output keeps."""

from __future__ import annotations

import json
from collections.abc import Generator, Iterator
from typing import Any

import pytest


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    if report.when == "call":
        item.stash[FAILED] = report.failed
    return report


FAILED = pytest.StashKey[bool]()


@pytest.fixture(autouse=True)
def _clean_after_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "session" not in request.fixturenames or not request.node.stash.get(FAILED, False):
        return
    s = request.getfixturevalue("session")
    left = [d["metadata"]["name"] for d in (s.get("inferencedeployments.shardwise.io") or {}).get("items", [])]
    _explain(s, left)
    for name in left:
        s.kubectl("delete", "inferencedeployment", name, "--wait=true", timeout=120, check=False)
    s.wait_for(lambda: not any(p["metadata"]["name"].startswith(tuple(left))
                               for p in (s.get("pods") or {}).get("items", [])), 60, f"the pods of {left} to go")


def _explain(s: Any, names: list[str]) -> None:
    """What a failed test left, for its report: each deployment's status and events, the operator log's tail."""
    try:
        for name in names:
            print(f"--- status of {name}:", json.dumps(s.status(name), indent=1, default=str))
            for e in (s.get("events") or {}).get("items", []):
                if e.get("involvedObject", {}).get("name") == name:
                    print(e.get("lastTimestamp"), e.get("reason"), e.get("message"))
        print("--- operator log (tail):", *s.operator_log.read_text(errors="replace").splitlines()[-120:], sep="\n")
        for p in (s.get("pods") or {}).get("items", []):  # the agents', routers' and engines' own words
            if (p["metadata"].get("labels") or {}).get("shardwise.io/deployment") in names:
                tail = s.pod_log(p["metadata"]["name"], p["metadata"].get("namespace", "default"))
                print(f"--- log of pod {p['metadata']['name']} (tail):", *tail.splitlines()[-40:], sep="\n")
    except Exception as e:  # a report, never a second failure
        print(f"(no explanation: {e!r})")
