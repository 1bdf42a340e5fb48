"""A failed operator test deletes the deployments it left, so that their pods do not hold the module cluster's
GPUs and fail the tests after it for want of room (one failure, not a cascade)."""

from __future__ import annotations

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
    for name in left:
        s.kubectl("delete", "inferencedeployment", name, "--wait=true", timeout=120, check=False)
    s.wait_for(lambda: not any(p["metadata"]["name"].startswith(tuple(left))
                               for p in (s.get("pods") or {}).get("items", [])), 60, f"the pods of {left} to go")
