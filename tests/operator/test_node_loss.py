"""A node lost under a serving deployment: powered off (its processes killed, its kubelet silent), found lost by the
local cluster's node lifecycle controller, its pods evicted but left Terminating as no kubelet confirms it. The
survivors serve at once, the lost pod is replaced on a node that is alive, and its name is never reused."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

pytest.importorskip("kopf")

from shardwise.devcluster.session import LocalSession

from tests.operator.common import (
    apply,
    assert_serves_like_the_oracle,
    delete,
    events,
    local_session,
    manifest,
    pods,
    wait_available,
    wait_status,
)
from tests.operator.test_elastic import Traffic, done, explicit

pytestmark = pytest.mark.slow
NODE_GRACE_S = 5.0


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    # one 2-GPU pod per node, and a third node for the replacement
    yield from local_session(tmp_path_factory, "nodeloss", nodes=3, gpus_per_node=2, node_grace=NODE_GRACE_S,
                             operator_env={"SHARDWISE_EPLB_CHECK_SECONDS": "3600"})


def test_a_lost_node_is_served_around_then_its_pod_replaced_on_a_live_node(session: LocalSession) -> None:
    s = session
    apply(s, manifest("nl"))
    st = wait_available(s, "nl", dpa=2)
    world = st["worldGeneration"]
    everything = (s.get("pods") or {}).get("items", [])
    router = {p["spec"].get("nodeName") for p in everything
              if p["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "router"}
    victim = next(p for p in pods(s, "nl") if p["spec"]["nodeName"] not in router)  # a worker pod without the router
    name, node = victim["metadata"]["name"], victim["spec"]["nodeName"]
    dead_url = f"http://{victim['status']['podIP']}:8000"
    group = str(next(p["ranks"][0] // 2 for p in st["pods"] if p["name"] == name))
    try:
        with Traffic(s, "nl") as traffic:
            s.wait_for(lambda: traffic.ok >= 3, 60, "traffic to flow")
            s.cluster.lose_node(node)  # type: ignore[union-attr]
            lost = time.monotonic()
            # the survivors' world answers before the node is even found lost
            s.wait_for(lambda: any(sent > lost and gen == world + 1 for sent, _group, gen in traffic.answered), 60,
                       "an answer to a request sent after the node was lost")
            found = s.wait_for(lambda: any(t["key"] == "node.kubernetes.io/unreachable"
                                           for t in (s.get("node", node).get("spec") or {}).get("taints") or []),
                               NODE_GRACE_S + 30, f"{node} to be found lost")
            assert found
            st = wait_status(s, "nl", lambda st: done("ScaleUp", 2)(st) and st["worldGeneration"] >= world + 2,
                             "nl back at dpa 2 on a live node")
            served = traffic.ok
            s.wait_for(lambda: traffic.ok >= served + 3, 60, "traffic to flow through the restored world")
        recovered = next(e["message"] for e in events(s, "nl") if e["reason"] == "Recovered")
        assert "recovered dpa 2 -> 1" in recovered, recovered
        # the lost pod stays Terminating (nothing on its node confirms the deletion); the new one has another name
        # and runs elsewhere
        old = s.get("pod", name)
        assert old is not None and old["metadata"].get("deletionTimestamp") and old["spec"]["nodeName"] == node
        replacement = [p for p in pods(s, "nl") if p["metadata"]["name"] != name and p["spec"]["nodeName"] != node]
        assert len(replacement) == 2 and len(st["pods"]) == 2 and name not in [p["name"] for p in st["pods"]]
        assert not traffic.wrong and explicit(traffic.lost, group, dead_url), traffic.report()
        assert_serves_like_the_oracle(st, "after a node was lost")
    finally:  # the lost pod stays Terminating until an admin removes it (else the teardown waits for it)
        s.kubectl("delete", "pod", name, "--grace-period=0", "--force", check=False)
    delete(s, "nl")
