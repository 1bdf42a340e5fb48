"""`make bench-devcluster`: the local cluster's speed on this machine (figures go into the README).

- watch latency: a ConfigMap written over HTTP until its event arrives on an open watch (200 writes);
- listing 5,000 ConfigMaps in one GET;
- pod start-to-Ready: pods created over HTTP (command `sleep`, no probe) until every one is Ready, for 1 and
  for 50 pods on 2 process-backed nodes.
"""

from __future__ import annotations

import json
import platform
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from shardwise.devcluster.apiserver import APIServer
from shardwise.devcluster.cluster import Cluster

OUT = Path(__file__).parent / "results" / "devcluster.json"


def call(url: str, method: str = "GET", body: Any = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def watch_latency(api: str, writes: int = 200) -> list[float]:
    seen: dict[str, float] = {}
    ready = threading.Event()

    def watcher() -> None:
        with urllib.request.urlopen(api + "/api/v1/namespaces/default/configmaps?watch=true&timeoutSeconds=120",
                                    timeout=130) as r:
            ready.set()
            for line in r:
                ev = json.loads(line)
                name = ev["object"]["metadata"]["name"]
                seen.setdefault(name, time.perf_counter())
                if len(seen) >= writes:
                    return

    t = threading.Thread(target=watcher, daemon=True)
    t.start()
    ready.wait(30)
    sent: dict[str, float] = {}
    for i in range(writes):
        name = f"lat-{i}"
        sent[name] = time.perf_counter()
        call(api + "/api/v1/namespaces/default/configmaps", "POST",
             {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"i": str(i)}})
    t.join(60)
    return [seen[n] - sent[n] for n in sent if n in seen]


def list_seconds(api: str, count: int = 5000) -> float:
    for i in range(count):
        call(api + "/api/v1/namespaces/default/configmaps", "POST",
             {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"bulk-{i}"}, "data": {"i": str(i)}})
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        items = call(api + "/api/v1/namespaces/default/configmaps")["items"]
        times.append(time.perf_counter() - t0)
        assert len(items) >= count
    return statistics.median(times)


def pods_ready(api: str, count: int) -> float:
    t0 = time.perf_counter()
    for i in range(count):
        call(api + "/api/v1/namespaces/default/pods", "POST", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"p{count}-{i}"},
            "spec": {"containers": [{"name": "c", "image": "none", "command": ["sleep", "600"]}]}})
    while True:
        pods = call(api + "/api/v1/namespaces/default/pods")["items"]
        ready = [p for p in pods if p["metadata"]["name"].startswith(f"p{count}-") and any(
            c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))]
        if len(ready) == count:
            return time.perf_counter() - t0
        time.sleep(0.02)


def main() -> None:
    rows: list[dict[str, Any]] = []
    with APIServer() as server:
        lat = sorted(watch_latency(server.url))
        rows.append({"what": "watch latency, write to event (median / p99 of 200)",
                     "value": f"{statistics.median(lat) * 1e3:.1f} ms / {lat[int(len(lat) * 0.99) - 1] * 1e3:.1f} ms"})
        rows.append({"what": "list 5,000 ConfigMaps", "value": f"{list_seconds(server.url) * 1e3:.0f} ms"})
    for count in (1, 50):
        with APIServer() as server, tempfile.TemporaryDirectory() as state, \
                Cluster(server.url, state_dir=state, nodes=2, gpus_per_node=4) as _cluster:
            rows.append({"what": f"pod start-to-Ready, {count} pod(s)",
                         "value": f"{pods_ready(server.url, count):.2f} s"})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": f"{platform.machine()} {platform.python_version()}", "rows": rows},
                              indent=2) + "\n")
    print("| measurement | value |\n|---|---|")
    for r in rows:
        print(f"| {r['what']} | {r['value']} |")
    print(f"\nwritten to {OUT}")


if __name__ == "__main__":
    main()
