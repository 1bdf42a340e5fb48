"""Gang creation: a world whose pods cannot all run before the gang deadline is reported, its pods deleted, and
the attempt retried after a backoff (30 s doubling to 10 min), not left half-scheduled."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("kopf")
pytest.importorskip("kmock")

from shardwise.devcluster.session import LocalSession
from shardwise.operator.status import parse_iso

from tests.operator.common import apply, delete, events, local_session, manifest, pods, wait_status

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    # one node with 2 GPUs: of tiny-moe's two 2-GPU pods only one can ever run
    yield from local_session(tmp_path_factory, "gang", nodes=1, gpus_per_node=2, operator_args=("--gang-timeout", "3"))


def test_a_world_that_cannot_all_run_is_deleted_and_retried_with_backoff(session: LocalSession) -> None:
    s = session
    apply(s, manifest("gang"))
    st = wait_status(s, "gang", lambda st: (st.get("gang") or {}).get("attempts") == 1, "the gang deadline", 60)
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "GangTimeout"
    assert "1 of 2 pods of world 1 running" in degraded["message"] and "retry 1 in 30 s" in degraded["message"]
    retry_at, since = parse_iso(st["gang"]["retryAt"]), parse_iso(st["gang"]["since"])
    assert retry_at is not None and since is not None and 30 <= retry_at - since <= 45
    s.wait_for(lambda: not pods(s, "gang"), 60, "the half-scheduled pods to go")
    assert s.status("gang")["phase"] == "Pending"
    assert "GangTimeout" in [e["reason"] for e in events(s, "gang")]
    delete(s, "gang")
