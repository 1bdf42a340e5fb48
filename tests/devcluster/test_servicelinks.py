"""Service link variables, as a kubelet injects them: a process-backed pod sees the Services of its namespace
(`SHARDWISE_METRICS_PORT=tcp://IP:PORT`...) unless its `enableServiceLinks` is false, and always the API server's
`KUBERNETES_SERVICE_HOST`/`_PORT`; its own `env` wins, and may reference them."""

from __future__ import annotations

import ipaddress
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

pytest.importorskip("kmock")

from shardwise.devcluster.apiserver import APIServer
from shardwise.devcluster.cluster import Cluster
from shardwise.devcluster.kubelet import SERVICE_LINK_RANGE

from tests.devcluster.test_nodes import Api, container, pod

pytestmark = pytest.mark.slow

PRINT_ENV = "env | grep -E '^(SHARDWISE_METRICS|WORKERS|FIXED|KUBERNETES|MINE)'"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Api, Cluster]]:
    with APIServer() as server, Cluster(server.url, nodes=1, gpus_per_node=0, lease_interval=0.3, stop_grace=2.0,
                                        state_dir=tmp_path_factory.mktemp("nodes")) as nodes:
        yield Api(server.url), nodes


@pytest.fixture
def ns(cluster: tuple[Api, Cluster]) -> str:
    """A fresh namespace with three Services: one without a cluster IP (as the local API server keeps them), a
    headless one and one with its own cluster IP (as a real API server allocates them)."""
    api, _ = cluster
    name = f"links-{uuid.uuid4().hex[:8]}"
    api.ok("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    services = f"/api/v1/namespaces/{name}/services"
    api.ok("POST", services, {"metadata": {"name": "shardwise-metrics"}, "spec": {
        "selector": {"app": "x"}, "ports": [{"name": "metrics", "port": 9090}, {"name": "grpc-api", "port": 9091}]}})
    api.ok("POST", services, {"metadata": {"name": "workers"}, "spec": {"clusterIP": "None", "ports": [{"port": 1}]}})
    api.ok("POST", services, {"metadata": {"name": "fixed"}, "spec": {"clusterIP": "10.0.0.7",
                                                                      "ports": [{"port": 53, "protocol": "UDP"}]}})
    return name


def run_env(api: Api, nodes: Cluster, namespace: str, name: str, **spec: object) -> dict[str, str]:
    """The service link variables a pod's process saw (it prints them and exits; the pod is then deleted)."""
    pods = f"/api/v1/namespaces/{namespace}/pods"
    env = [{"name": "MINE", "value": "at $(SHARDWISE_METRICS_SERVICE_HOST)"},
           {"name": "SHARDWISE_METRICS_SERVICE_PORT", "value": "own"}]
    api.ok("POST", pods, pod(name, container("main", "sh", "-c", PRINT_ENV, env=env), restartPolicy="Never", **spec))
    try:
        done = api.wait(pods, name, lambda p: ((p or {}).get("status") or {}).get("phase") in ("Succeeded", "Failed"))
        assert done is not None and done["status"]["phase"] == "Succeeded", done
        return dict(line.split("=", 1) for line in nodes.log(namespace, name).splitlines())
    finally:
        api.ok("DELETE", f"{pods}/{name}")
        api.wait(pods, name, lambda p: p is None)


def test_a_pod_sees_the_services_of_its_namespace_and_the_api_server_and_its_own_env_wins(
        cluster: tuple[Api, Cluster], ns: str) -> None:
    api, nodes = cluster
    env = run_env(api, nodes, ns, "linked")
    ip = env["SHARDWISE_METRICS_SERVICE_HOST"]
    assert ipaddress.ip_address(ip) in SERVICE_LINK_RANGE
    assert {key: value for key, value in env.items() if key.startswith("SHARDWISE_METRICS")} == {
        "SHARDWISE_METRICS_SERVICE_HOST": ip, "SHARDWISE_METRICS_SERVICE_PORT": "own",
        "SHARDWISE_METRICS_SERVICE_PORT_METRICS": "9090", "SHARDWISE_METRICS_SERVICE_PORT_GRPC_API": "9091",
        "SHARDWISE_METRICS_PORT": f"tcp://{ip}:9090",
        "SHARDWISE_METRICS_PORT_9090_TCP": f"tcp://{ip}:9090", "SHARDWISE_METRICS_PORT_9090_TCP_PROTO": "tcp",
        "SHARDWISE_METRICS_PORT_9090_TCP_PORT": "9090", "SHARDWISE_METRICS_PORT_9090_TCP_ADDR": ip,
        "SHARDWISE_METRICS_PORT_9091_TCP": f"tcp://{ip}:9091", "SHARDWISE_METRICS_PORT_9091_TCP_PROTO": "tcp",
        "SHARDWISE_METRICS_PORT_9091_TCP_PORT": "9091", "SHARDWISE_METRICS_PORT_9091_TCP_ADDR": ip}
    assert env["MINE"] == f"at {ip}"
    assert (env["FIXED_SERVICE_HOST"], env["FIXED_PORT"], env["FIXED_PORT_53_UDP_PROTO"]) == (
        "10.0.0.7", "udp://10.0.0.7:53", "udp")
    assert not any(key.startswith("WORKERS_") for key in env)  # headless: no variables
    server = urlsplit(api.url)
    assert (env["KUBERNETES_SERVICE_HOST"], env["KUBERNETES_SERVICE_PORT"]) == (server.hostname, str(server.port))
    assert env["KUBERNETES_PORT"] == f"tcp://{server.hostname}:{server.port}"
    assert run_env(api, nodes, ns, "again")["SHARDWISE_METRICS_SERVICE_HOST"] == ip  # the same for every pod


def test_a_pod_without_service_links_sees_only_the_api_server(cluster: tuple[Api, Cluster], ns: str) -> None:
    api, nodes = cluster
    env = run_env(api, nodes, ns, "unlinked", enableServiceLinks=False)
    assert not any(key.startswith(("SHARDWISE_METRICS_PORT", "FIXED_")) for key in env), env
    assert env["SHARDWISE_METRICS_SERVICE_PORT"] == "own"
    assert env["MINE"] == "at $(SHARDWISE_METRICS_SERVICE_HOST)"  # nothing to expand
    assert env["KUBERNETES_SERVICE_PORT"] == str(urlsplit(api.url).port)
