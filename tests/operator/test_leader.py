"""Leader election on a Lease through the emulator's HTTP API: one replica acts, a takeover only after expiry."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")
pytest.importorskip("kubernetes")

from shardwise.devcluster.apiserver import APIServer
from shardwise.operator.kube import Kube, KubeError, load_config
from shardwise.operator.leader import LeaderElector


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[Kube]:
    with APIServer() as server:
        k = Kube(load_config(str(server.write_kubeconfig(tmp_path / "kubeconfig"))))
        yield k
        k.close()


def test_one_replica_leads_until_its_lease_expires(kube: Kube) -> None:
    clock = Clock()
    a = LeaderElector(kube, "default", "shardwise", "replica-a", duration_s=15, clock=clock)
    b = LeaderElector(kube, "default", "shardwise", "replica-b", duration_s=15, clock=clock)
    assert a.try_acquire()
    assert not b.try_acquire()  # held and fresh
    clock.now += 10
    assert a.try_acquire()  # renewal by the holder
    clock.now += 10
    assert not b.try_acquire()  # renewed 10 s ago: still a's
    clock.now += 6
    assert b.try_acquire()  # 16 s without renewal: taken over
    assert not a.try_acquire()
    lease = kube.get("Lease", "default", "shardwise")
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == "replica-b" and lease["spec"]["leaseTransitions"] == 1


class Outage(Kube):
    """The API server as the holder sees it: every request fails with 503 while `down` is set."""

    down = False

    def request(self, method: str, url_path: str, body: Any = None, **kwargs: Any) -> Any:
        if self.down:
            raise KubeError(503, "the API server is unavailable")
        return super().request(method, url_path, body, **kwargs)


def test_a_holder_that_cannot_renew_steps_down_before_anyone_may_take_over(kube: Kube, tmp_path: Path) -> None:
    clock = Clock()
    holder_kube = Outage(kube.api.configuration)
    a = LeaderElector(holder_kube, "default", "outage", "replica-a", duration_s=15, renew_deadline_s=10, clock=clock)
    b = LeaderElector(kube, "default", "outage", "replica-b", duration_s=15, renew_deadline_s=10, clock=clock)
    assert a.try_acquire()
    last = clock.now
    holder_kube.down = True
    clock.now += 5
    assert a.renew(last) == last  # a failed renewal inside the deadline: still leading, retried
    clock.now += 5
    assert a.renew(last) is None  # 10 s without a renewal: a stops acting
    assert not b.try_acquire()  # while the Lease, renewed 10 s ago, is still a's: no two replicas act at once
    clock.now += 6
    assert b.try_acquire()
    holder_kube.down = False
    assert a.renew(clock.now - 1) is None  # back in touch, a finds the Lease taken and does not resume
    holder_kube.close()


def test_a_renew_deadline_not_below_the_lease_duration_is_refused(kube: Kube) -> None:
    with pytest.raises(ValueError, match=r"renew deadline \(15 s\) < lease duration \(15 s\)"):
        LeaderElector(kube, "default", "x", "a", duration_s=15, renew_deadline_s=15)


def test_a_released_lease_is_taken_at_once(kube: Kube) -> None:
    clock = Clock()
    a = LeaderElector(kube, "default", "shardwise", "replica-a", clock=clock)
    b = LeaderElector(kube, "default", "shardwise", "replica-b", clock=clock)
    assert a.try_acquire()
    a.release()
    assert b.try_acquire()


def test_a_stale_write_loses_the_race(kube: Kube) -> None:
    """Both replicas read an expired lease; the second write carries an old resourceVersion and gets 409."""
    clock = Clock()
    a = LeaderElector(kube, "default", "race", "replica-a", clock=clock)
    assert a.try_acquire()
    clock.now += 60
    stale = kube.get("Lease", "default", "race")
    b = LeaderElector(kube, "default", "race", "replica-b", clock=clock)
    assert b.try_acquire()
    assert stale is not None
    stale["spec"]["holderIdentity"] = "replica-c"
    from shardwise.operator.kube import KubeError, path

    with pytest.raises(KubeError) as e:
        kube.request("PUT", path("Lease", "default", "race"), stale)
    assert e.value.status == 409


@pytest.mark.slow
def test_of_two_operator_processes_only_one_acts_until_it_dies(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess

    from shardwise.devcluster.session import LocalSession

    from tests.conftest import shardwise_command

    with APIServer() as server:
        config = server.write_kubeconfig(tmp_path / "kubeconfig")
        procs, logs = [], []
        try:
            for i in range(2):
                logs.append(tmp_path / f"operator-{i}.log")
                with open(logs[-1], "wb") as out:
                    procs.append(subprocess.Popen(
                        [*shardwise_command(), "operator", "--kubeconfig", str(config), "--leader-election-name",
                         "shardwise-leader", "--leader-election-namespace", "default"],
                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ,
                                                                                              "POD_NAME": f"op-{i}"}))

            def leaders() -> list[int]:
                return [i for i, log in enumerate(logs) if "operator: leading" in log.read_text()]

            first = LocalSession.wait_for(leaders, 60, "a leader")
            assert len(first) == 1
            other = 1 - first[0]
            LocalSession.wait_for(lambda: "waiting for the lease" in logs[other].read_text(), 30, "the standby")
            assert leaders() == first  # the standby does not act while the lease is held
            os.killpg(procs[first[0]].pid, signal.SIGKILL)  # the leader dies without releasing the lease
            procs[first[0]].wait(10)
            LocalSession.wait_for(lambda: other in leaders(), 60, "the standby to take over after the lease expired")
            client = Kube(load_config(str(config)))
            lease = client.get("Lease", "default", "shardwise-leader")
            client.close()
            assert lease is not None and lease["spec"]["holderIdentity"] == f"op-{other}"
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(30)
