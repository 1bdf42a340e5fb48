"""An operator installed for some namespaces (the chart's watchNamespaces: `--namespace` per namespace) serves the
deployments there and leaves those of any other namespace alone: no status, no finalizer, no pods."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml

pytest.importorskip("kopf")
pytest.importorskip("kmock")

from shardwise.devcluster.session import LocalSession

from tests.operator.common import assert_serves_like_the_oracle, local_session, manifest, wait_status

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    yield from local_session(tmp_path_factory, "namespaced", operator_args=("--namespace", "team-a"),
                             operator_env={"SHARDWISE_EPLB_CHECK_SECONDS": "3600"})


def test_only_the_watched_namespace_is_served(session: LocalSession) -> None:
    s = session
    for ns in ("team-a", "team-b"):
        namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
        s.kubectl("apply", "-f", "-", input=yaml.safe_dump(namespace))
    s.kubectl("apply", "-n", "team-b", "-f", "-", input=manifest("elsewhere"))
    s.kubectl("apply", "-n", "team-a", "-f", "-", input=manifest("served"))
    st = wait_status(s, "served", lambda st: st.get("phase") == "Running" and st.get("dpa") == 2, "served Available",
                     namespace="team-a")
    assert_serves_like_the_oracle(st)
    # by now the operator has seen both (team-b's first): the other namespace's deployment was never touched
    other = s.get("inferencedeployments.shardwise.io", "elsewhere", "team-b")
    assert other is not None and not other.get("status") and not other["metadata"].get("finalizers"), other
    assert not (s.get("pods", namespace="team-b") or {}).get("items")
    s.kubectl("delete", "inferencedeployment", "served", "-n", "team-a", "--wait=true", timeout=120)
    s.kubectl("delete", "inferencedeployment", "elsewhere", "-n", "team-b", "--wait=true", timeout=120)
