"""`make bench-operator`: how the operator's work grows with the number of deployments (figures go into the README).

- control plane (API server, no nodes): N tiny-moe deployments (2 pods each) applied at once with one
  `kubectl apply`; seconds until every pod exists; Kubernetes API requests per second and per reconcile step
  (from the operator's own /metrics) while the deployments wait for their pods, with the operator-wide discovery
  requests (is the InferencePool API served: one every 15 s) counted apart; then one pod of each deployment deleted
  with kubectl and the requests the operator spends making them again, per deployment; for N = 1, 8, 64;
- to Available (2 process-backed nodes): N one-pod deployments of tiny-moe (tp=1, dpa=1: an agent and one
  rank process each) applied at once; seconds until every pod exists and until every deployment is Available,
  for N = 1 and 8 (64 would be 128 processes of torch: more than a 2-core, 24 GiB machine holds).
"""

from __future__ import annotations

import json
import platform
import re
import socket
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from shardwise.devcluster.apiserver import APIServer, write_kubeconfig
from shardwise.devcluster.session import LocalSession

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "operator.json"
EXAMPLE = yaml.safe_load((ROOT / "examples" / "tiny-moe.yaml").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def manifests(n: int, *, one_pod: bool) -> str:
    docs = []
    for i in range(n):
        body = json.loads(json.dumps(EXAMPLE))
        body["metadata"]["name"] = f"bench-{i}"
        if one_pod:
            body["spec"]["parallelism"].update(tp=1, dpa=1)
            body["spec"]["hardware"]["gpusPerNode"] = 1
            body["spec"]["eplb"] = {"enabled": False}
        docs.append(body)
    return yaml.safe_dump_all(docs)


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def count_pods(s: LocalSession) -> int:
    return len((s.get("pods") or {}).get("items", []))


class ControlPlane(LocalSession):
    """A session without nodes: pods are created and stay Pending."""

    def start(self) -> LocalSession:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.api = APIServer()
        write_kubeconfig(self.kubeconfig, self.api.start())
        self.kubectl("apply", "-f", str(self.crd))
        self.start_operator()
        return self


def control_plane(n: int) -> dict[str, Any]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, ControlPlane(tmp, operator_args=("--metrics-port", str(port))) as s:
        LocalSession.wait_for(lambda: _answers(port), 60, "the operator's metrics")
        started = time.monotonic()
        s.kubectl("apply", "-f", "-", input=manifests(n, one_pod=False), timeout=300)
        s.wait_for(lambda: count_pods(s) >= 2 * n, 600, f"{2 * n} pods", interval=0.1)
        created = time.monotonic() - started
        time.sleep(5)  # a steady window: every deployment waits for its pods (a benchmark, not a test)
        steps, requests, discovery = ("shardwise_operator_reconciles_total", "shardwise_operator_api_requests_total",
                                      "shardwise_operator_api_discovery_requests_total")
        r0, q0, d0 = metric(port, steps), metric(port, requests), metric(port, discovery)
        t0 = time.monotonic()
        time.sleep(30)
        r1, q1, d1 = metric(port, steps), metric(port, requests), metric(port, discovery)
        window = time.monotonic() - t0
        # one pod of each deployment deleted by hand: the requests the operator spends to make them again
        q2, d2 = metric(port, requests), metric(port, discovery)
        s.kubectl("delete", "pod", *[f"bench-{i}-1" for i in range(n)], "--wait=true", timeout=300)
        s.wait_for(lambda: count_pods(s) >= 2 * n, 600, f"{2 * n} pods again", interval=0.1)
        time.sleep(5)  # the steps that follow the new pods' events
        q3, d3 = metric(port, requests), metric(port, discovery)
        return {"deployments": n, "pods": 2 * n, "all_pods_created_s": round(created, 2),
                "reconciles_per_s": round((r1 - r0) / window, 1),
                "api_requests_per_s": round((q1 - q0 - (d1 - d0)) / window, 2),
                "discovery_requests_per_s": round((d1 - d0) / window, 2),
                "api_requests_per_reconcile": round((q1 - q0 - (d1 - d0)) / max(1.0, r1 - r0), 2),
                "api_requests_per_pod_replaced": round((q3 - q2 - (d3 - d2)) / n, 2)}


def _answers(port: int) -> bool:
    try:
        metric(port, "shardwise_operator_reconciles_total")
        return True
    except OSError:
        return False


def to_available(n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, LocalSession(tmp, nodes=2, gpus_per_node=max(4, n)) as s:
        started = time.monotonic()
        s.kubectl("apply", "-f", "-", input=manifests(n, one_pod=True), timeout=120)
        s.wait_for(lambda: count_pods(s) >= n, 300, f"{n} pods", interval=0.1)
        created = time.monotonic() - started

        def all_available() -> bool:
            items = (s.get("inferencedeployments.shardwise.io") or {}).get("items", [])
            return len(items) == n and all((i.get("status") or {}).get("phase") == "Running" for i in items)

        s.wait_for(all_available, 900, f"{n} deployments Available", interval=0.2)
        available = time.monotonic() - started
        s.kubectl("delete", "inferencedeployments.shardwise.io", "--all", "--wait=true", timeout=300)
        return {"deployments": n, "pods": n, "all_pods_created_s": round(created, 2),
                "all_available_s": round(available, 2)}


def main() -> None:
    results: dict[str, Any] = {"machine": f"{platform.machine()}, {__import__('os').cpu_count()} cpus",
                               "control_plane": [], "to_available": []}
    for n in (1, 8, 64):
        results["control_plane"].append(row := control_plane(n))
        print("control plane", row, flush=True)
    for n in (1, 8):
        results["to_available"].append(row := to_available(n))
        print("to available", row, flush=True)
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
