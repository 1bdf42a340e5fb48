"""The operator's watch-fed cache (operator/cache.py) on the local API server: reads answered without a request
once listed, changes seen through the watch, the operator's own writes read back at once and never undone by an
older event, and a restarted API server whose history is gone listed again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kmock")
pytest.importorskip("kubernetes")

from shardwise.devcluster.apiserver import APIServer
from shardwise.operator import cache as cache_module
from shardwise.operator.cache import MANAGED, Cache, Informer
from shardwise.operator.kube import Kube, KubeError, load_config

LABELS = {"app.kubernetes.io/managed-by": "shardwise", "shardwise.io/deployment": "llm"}


def configmap(name: str, data: str = "1", labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "data": {"v": data},
            "metadata": {"name": name, "namespace": "default", "labels": LABELS if labels is None else labels}}


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "not seen before the deadline"
        time.sleep(0.02)


@pytest.fixture
def server() -> Iterator[APIServer]:
    with APIServer() as s:
        yield s


@pytest.fixture
def kube(server: APIServer, tmp_path: Path) -> Iterator[Kube]:
    k = Kube(load_config(str(server.write_kubeconfig(tmp_path / "kubeconfig"))))
    yield k
    k.close()


@pytest.fixture
def writer(server: APIServer, tmp_path: Path) -> Iterator[Kube]:
    """Another client (a user, kubectl): its writes reach the cache only through the watch."""
    k = Kube(load_config(str(server.write_kubeconfig(tmp_path / "writer"))))
    yield k
    k.close()


def informer(kube: Kube, changes: list[tuple[Any, Any]] | None = None) -> Informer:
    inf = Informer(kube, "ConfigMap", (), MANAGED,
                   on_change=None if changes is None else lambda _kind, old, new: changes.append((old, new)))
    inf.start()
    assert inf.wait_synced(10)
    return inf


def test_reads_after_the_first_list_cost_no_request_and_see_other_clients_changes(kube: Kube, writer: Kube) -> None:
    writer.create(configmap("before"))
    writer.create(configmap("unmanaged", labels={"app": "other"}))
    changes: list[tuple[Any, Any]] = []
    kube.cache = cache = Cache(kube, (), lambda _k, old, new: changes.append((old, new)), kinds={"ConfigMap": MANAGED})
    cache.start()
    try:
        assert cache.wait_synced(10)
        sent = kube.requests
        assert kube.get("ConfigMap", "default", "before")["data"] == {"v": "1"}  # type: ignore[index]
        assert kube.get("ConfigMap", "default", "unmanaged") is None  # not what the operator manages
        assert [c["metadata"]["name"] for c in kube.list("ConfigMap", "default", "shardwise.io/deployment=llm")] \
            == ["before"]
        assert kube.requests == sent
        writer.create(configmap("after"))
        writer.patch("ConfigMap", "default", "before", {"data": {"v": "2"}})
        writer.delete("ConfigMap", "default", "after")
        eventually(lambda: (kube.get("ConfigMap", "default", "before") or {}).get("data") == {"v": "2"}
                   and any(new is None for _, new in changes))
        assert kube.get("ConfigMap", "default", "after") is None
        assert [(old and old["metadata"]["name"], new and new["data"]["v"]) for old, new in changes] == [
            (None, "1"), (None, "1"), ("before", "2"), ("after", None)]
        assert kube.requests == sent
        # a kind the cache does not hold is read from the API
        assert kube.get("Secret", "default", "nothing") is None
        assert kube.requests == sent + 1
    finally:
        cache.stop()


def test_the_operators_own_write_is_read_back_at_once_and_no_older_event_undoes_it(kube: Kube, writer: Kube) -> None:
    writer.create(configmap("plan"))
    kube.cache = cache = Cache(kube, (), None, kinds={"ConfigMap": MANAGED})
    cache.start()
    try:
        assert cache.wait_synced(10)
        older = kube.get("ConfigMap", "default", "plan")
        assert older is not None
        for v in range(2, 12):
            kube.patch("ConfigMap", "default", "plan", {"data": {"v": str(v)}})
            assert kube.get("ConfigMap", "default", "plan")["data"] == {"v": str(v)}  # type: ignore[index]
        informer_ = cache.informers["ConfigMap"]
        informer_.observe(older)  # a late answer or event from before: dropped
        assert kube.get("ConfigMap", "default", "plan")["data"] == {"v": "11"}  # type: ignore[index]
        assert kube.create(configmap("made")) is not None
        assert kube.get("ConfigMap", "default", "made") is not None  # before its ADDED event, maybe
        kube.delete("ConfigMap", "default", "made")
        eventually(lambda: kube.get("ConfigMap", "default", "made") is None)
        made = configmap("made")
        made["metadata"]["resourceVersion"] = "1"  # an answer from before the deletion: the object stays gone
        informer_.observe(made)
        assert kube.get("ConfigMap", "default", "made") is None
    finally:
        cache.stop()


def test_an_api_server_restarted_without_the_history_is_listed_again(server: APIServer, kube: Kube,
                                                                    tmp_path: Path) -> None:
    kube.create(configmap("stays"))
    kube.create(configmap("goes"))
    changes: list[tuple[Any, Any]] = []
    inf = informer(kube, changes)
    try:
        port = server.port
        # the server goes down; meanwhile the objects change (a restore of a later snapshot, as after a restart
        # whose history was compacted): the informer's resourceVersion is older than anything the new one keeps
        with APIServer() as other:
            other_kube = Kube(load_config(str(other.write_kubeconfig(tmp_path / "other"))))
            for name in ("stays", "goes"):
                other_kube.create(configmap(name))
            other_kube.patch("ConfigMap", "default", "stays", {"data": {"v": "changed"}})
            other_kube.delete("ConfigMap", "default", "goes")
            other_kube.create(configmap("new"))
            for _ in range(20):  # past the first server's revisions
                other_kube.patch("ConfigMap", "default", "new", {"data": {"v": str(time.monotonic_ns())}})
            snapshot = other.snapshot()
            other_kube.close()
        server.stop()
        # the same server again: its ports and credentials (the informer's kubeconfig trusts them), later objects
        with APIServer(port=port, secure_port=server.secure_port, credentials=server.credentials, restore=snapshot):
            eventually(lambda: inf.relists >= 1 and inf.get("default", "goes") is None, timeout=20)
            assert inf.get("default", "stays")["data"] == {"v": "changed"}  # type: ignore[index]
            assert inf.get("default", "new") is not None
            assert ("goes", None) in [(old and old["metadata"]["name"], new) for old, new in changes]
            inf.stop()
            inf.join(5)
            # its watch thread ends with it (on a loaded machine it may take the watch's read a while)
            eventually(lambda: not any(t.is_alive() for t in threading.enumerate()
                                       if t.name.startswith("informer-ConfigMap")), timeout=60)
    finally:
        inf.stop()


def test_a_kind_whose_api_is_not_served_reads_as_none_without_holding_up_the_start(kube: Kube) -> None:
    inf = Informer(kube, "InferencePool", (), MANAGED)  # no CRD for it on this server
    inf.start()
    try:
        assert inf.wait_synced(10)
        assert inf.get("default", "llm") is None
        assert inf.list("default", "shardwise.io/deployment=llm") == []
    finally:
        inf.stop()


def test_an_api_server_that_does_not_answer_is_a_kube_error_saying_so(tmp_path: Path) -> None:
    with APIServer() as gone:
        config = gone.write_kubeconfig(tmp_path / "gone")
    k = Kube(load_config(str(config)))  # its server stopped: nothing listens there any more
    try:
        with pytest.raises(KubeError) as caught:
            k.get("Pod", "default", "llm-0")
        assert caught.value.status == 0 and caught.value.unavailable
        assert "the API server did not answer GET /api/v1/namespaces/default/pods/llm-0" in str(caught.value)
        assert "refused" in str(caught.value).lower(), caught.value
    finally:
        k.close()


def test_the_deletions_it_remembers_are_bounded(kube: Kube) -> None:
    inf = Informer(kube, "ConfigMap")
    for i in range(cache_module.TOMBSTONES + 500):
        inf._apply(("default", f"c{i}"), None, i)  # deletions of objects it never held, each remembered
    assert len(inf._deleted) == cache_module.TOMBSTONES
    assert ("default", f"c{cache_module.TOMBSTONES + 499}") in inf._deleted  # the newest are kept
