"""The kind tier: shardwise on a real Kubernetes cluster in Docker (`make e2e-kind`).

Every test here is skipped, with the reason, when `docker`, `kind` or `kubectl` is not on PATH, or the kind
cluster (`shardwise`, or $SHARDWISE_KIND_CLUSTER) does not exist or does not answer. The check runs once, at
collection, and only when a test of this folder was collected; without the tools it costs a PATH lookup.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
CLUSTER = os.environ.get("SHARDWISE_KIND_CLUSTER", "shardwise")
CONTEXT = f"kind-{CLUSTER}"
PROBE_TIMEOUT_S = 20


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "no output")


def unavailable() -> str | None:
    """Why the kind cluster cannot be used here, or None when it can."""
    for tool in ("docker", "kind", "kubectl"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not on PATH (the kind tests need docker, kind and kubectl; then `make e2e-kind`)"
    try:
        clusters = subprocess.run(["kind", "get", "clusters"], capture_output=True, text=True,
                                  timeout=PROBE_TIMEOUT_S)
        if CLUSTER not in clusters.stdout.split():
            detail = f" ({_first_line(clusters.stderr)})" if clusters.returncode else ""
            return f"there is no kind cluster '{CLUSTER}'{detail}: run `make kind-up kind-load`"
        ready = subprocess.run(["kubectl", "--context", CONTEXT, "get", "--raw", "/readyz"], capture_output=True,
                               text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        return f"`{' '.join(map(str, e.cmd))}` did not answer within {PROBE_TIMEOUT_S} s"
    if ready.returncode != 0:
        return f"the kind cluster '{CLUSTER}' does not answer (context {CONTEXT}): {_first_line(ready.stderr)}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if HERE in Path(item.path).resolve().parents]
    if not mine:
        return
    reason = unavailable()
    if reason is not None:
        for item in mine:
            item.add_marker(pytest.mark.skip(reason=f"kind e2e: {reason}"))
