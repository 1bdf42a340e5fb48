"""`shardwise dev`: the local cluster as a background process.

`up` starts `shardwise dev serve` in its own session (API server emulator, process-backed nodes and the
scheduler, optionally Prometheus), waits until the API answers, and writes `.shardwise/dev/kubeconfig` (the admin
over HTTPS, as the nodes connect too) and a state file with the server's PID and addresses (`api`: its plain-HTTP
port, where a request without credentials is the admin's). `down` stops that process group by PID (the nodes stop
every pod process they started), so nothing is left behind and the ports are free. `status` and `logs POD`
read the state directory. `nodes` attaches process-backed nodes and a scheduler to any cluster, in the
foreground.

`up --persist` keeps the API's objects across `down` and `up`. On a clean stop (SIGTERM, as `down` sends) `serve`
writes the API server's snapshot (every live object at its latest version, metadata intact, and the
resourceVersion counter; see apiserver.py) to STATE_DIR/objects.json, atomically, without what a restart does not
keep (`kept_across_restarts`): Pods, whose processes end with the cluster and whose owners create them again (the
shardwise operator recreates its workers; a bare Pod is gone), Nodes and their Leases, which the nodes register
again, Events, and every object whose owners are all among these. The next `up --persist` loads the file before
the API answers; resourceVersions continue after the stored ones, so a client's never go backwards. A run killed
(SIGKILL, a crash) writes nothing, and the file keeps the previous clean stop. `up` without `--persist` starts
empty and removes the file: objects are kept from one `--persist` run to the next only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_DIR = Path(".shardwise/dev")
STATE = "state.json"
OBJECTS = "objects.json"
# (group, plural) of the kinds a restart does not keep: the processes behind Pods end with the cluster, the nodes
# register again, Events describe the run that ended.
NOT_KEPT = frozenset({("", "pods"), ("", "nodes"), ("", "events"), ("events.k8s.io", "events")})
PROMETHEUS_REFRESH_S = 2.0


@dataclass
class DevState:
    pid: int
    api: str
    kubeconfig: str
    nodes: int
    gpus_per_node: int
    prometheus: str = ""
    ready: bool = False
    persist: bool = False


def check_state_dir(state_dir: Path) -> None:
    """Create STATE_DIR and write a file in it; OSError when it cannot be (a read-only place, a file on the way)."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=state_dir):
        pass


def read_state(state_dir: Path) -> DevState | None:
    try:
        return DevState(**json.loads((state_dir / STATE).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return True


def kept_across_restarts(snapshot: dict[str, Any]) -> dict[str, Any]:
    """The API server's snapshot without what a restart does not keep: the kinds of NOT_KEPT and every object whose
    owners in the snapshot are all dropped (a node's Lease), as the garbage collector would collect them."""
    from shardwise.devcluster.objects import meta, owner_uids

    entries = snapshot["objects"]
    uids = {meta(entry["object"]).get("uid") for entry in entries}
    dropped = {meta(entry["object"]).get("uid") for entry in entries
               if (entry["resource"][0], entry["resource"][2]) in NOT_KEPT}
    while True:
        orphans = {meta(entry["object"]).get("uid") for entry in entries
                   if (owners := owner_uids(entry["object"]) & uids) and owners <= dropped} - dropped
        if not orphans:
            break
        dropped |= orphans
    return {**snapshot, "objects": [entry for entry in entries if meta(entry["object"]).get("uid") not in dropped]}


def save_objects(state_dir: Path, snapshot: dict[str, Any]) -> Path:
    """Write STATE_DIR/objects.json atomically: a reader (or a crash) sees the old file or the new one, whole."""
    target, partial = state_dir / OBJECTS, state_dir / f"{OBJECTS}.tmp"
    with partial.open("w") as f:
        json.dump(snapshot, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, target)
    return target


def load_objects(state_dir: Path) -> dict[str, Any] | None:
    """STATE_DIR/objects.json, None when there is none; ValueError when it is not a JSON object."""
    path = state_dir / OBJECTS
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from e
    if not isinstance(loaded, dict):
        raise ValueError("not a JSON object")
    return loaded


def serve(state_dir: Path, *, nodes: int, gpus_per_node: int, prometheus: bool, persist: bool = False) -> int:
    """The body of the background process: run until SIGTERM, then stop everything it started (and, with
    `persist`, keep the API's objects in STATE_DIR/objects.json)."""
    from shardwise.devcluster.aiokube import load_kubeconfig
    from shardwise.devcluster.apiserver import APIServer
    from shardwise.devcluster.cluster import Cluster

    state_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if not persist:
        (state_dir / OBJECTS).unlink(missing_ok=True)
    try:
        api = APIServer(restore=load_objects(state_dir) if persist else None)
    except ValueError as e:  # a malformed file: say so, and keep it for the user to look at
        print(f"cannot restore the objects of {state_dir / OBJECTS}: {e}\nremove the file or start without "
              "--persist to begin empty", file=sys.stderr, flush=True)
        return 1
    url = api.start()
    kubeconfig = state_dir / "kubeconfig"
    api.write_kubeconfig(kubeconfig)
    cluster = Cluster(load_kubeconfig(kubeconfig), state_dir=state_dir, nodes=nodes, gpus_per_node=gpus_per_node)
    prom = None
    try:
        cluster.start()
        if prometheus:
            from shardwise.devcluster.prometheus import PrometheusServer

            prom = PrometheusServer(state_dir / "prometheus")
            prom.start()
        state = DevState(pid=os.getpid(), api=url, kubeconfig=str(kubeconfig.resolve()), nodes=nodes,
                         gpus_per_node=gpus_per_node, prometheus=prom.url if prom else "", ready=True,
                         persist=persist)
        (state_dir / STATE).write_text(json.dumps(asdict(state), indent=2) + "\n")
        print(f"dev cluster ready: {url}", flush=True)
        while not stop.wait(PROMETHEUS_REFRESH_S):
            if prom is not None:
                prom.set_targets(*_metrics_targets(url))
        if persist:  # a clean stop; before the nodes stop: their last writes are to Pods and Nodes, not kept
            saved = save_objects(state_dir, kept_across_restarts(api.snapshot()))
            print(f"dev cluster objects kept in {saved}", flush=True)
    finally:
        if prom is not None:
            prom.stop()
        cluster.stop()
        api.stop()
        (state_dir / STATE).unlink(missing_ok=True)
    return 0


def _metrics_targets(api: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """host:port of every running pod's container port named `metrics`, with its namespace and pod labels."""
    with urllib.request.urlopen(api + "/api/v1/pods?fieldSelector=status.phase%3DRunning", timeout=10) as r:
        pods = json.load(r).get("items", [])
    targets, labels = [], {}
    for pod in pods:
        ip = pod.get("status", {}).get("podIP")
        for c in pod.get("spec", {}).get("containers", []):
            for port in c.get("ports", []):
                if ip and port.get("name") == "metrics":
                    t = f"{ip}:{port['containerPort']}"
                    targets.append(t)
                    labels[t] = {"namespace": pod["metadata"].get("namespace", ""), "pod": pod["metadata"]["name"]}
    return targets, labels


def up(state_dir: Path, *, nodes: int, gpus_per_node: int, prometheus: bool, persist: bool = False,
       timeout: float = 120) -> DevState:
    """Start the background cluster (or return the running one, as it was started); raises RuntimeError when it
    cannot. With `persist` it starts from the objects a previous `persist` run kept, and keeps them at its stop."""
    current = read_state(state_dir)
    if current is not None and _alive(current.pid):
        return current
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / STATE).unlink(missing_ok=True)
    script = Path(sys.executable).parent / "shardwise"
    flags = [flag for flag, on in (("--prometheus", prometheus), ("--persist", persist)) if on]
    cmd = [str(script), "dev", "serve", "--state-dir", str(state_dir), "--nodes", str(nodes),
           "--gpus-per-node", str(gpus_per_node), *flags]
    log = open(state_dir / "dev.log", "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    log.close()
    deadline = time.monotonic() + timeout
    while (state := read_state(state_dir)) is None or not state.ready:
        if proc.poll() is not None:
            raise RuntimeError(f"the dev cluster exited with code {proc.returncode}; see {state_dir / 'dev.log'}")
        if time.monotonic() > deadline:
            down(state_dir)
            raise RuntimeError(f"the dev cluster was not ready within {timeout:g} s; see {state_dir / 'dev.log'}")
        time.sleep(0.2)  # polling a starting process
    with urllib.request.urlopen(state.api + "/version", timeout=10) as r:
        r.read()
    return state


def down(state_dir: Path, timeout: float = 30) -> bool:
    """Stop the background cluster by PID; False when none was running."""
    state = read_state(state_dir)
    if state is None or not _alive(state.pid):
        (state_dir / STATE).unlink(missing_ok=True)
        return False
    os.killpg(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(state.pid) and time.monotonic() < deadline:
        time.sleep(0.1)  # waiting for the process to finish its own shutdown
    if _alive(state.pid):
        os.killpg(state.pid, signal.SIGKILL)
    (state_dir / STATE).unlink(missing_ok=True)
    return True


def status(state_dir: Path) -> dict[str, Any]:
    state = read_state(state_dir)
    if state is None or not _alive(state.pid):
        return {"running": False}
    with urllib.request.urlopen(state.api + "/api/v1/nodes", timeout=10) as r:
        nodes = json.load(r).get("items", [])
    with urllib.request.urlopen(state.api + "/api/v1/pods", timeout=10) as r:
        pods = json.load(r).get("items", [])
    ready = [n["metadata"]["name"] for n in nodes
             if any(c.get("type") == "Ready" and c.get("status") == "True" for c in n.get("status", {}).get(
                 "conditions", []))]
    return {"running": True, **asdict(state), "nodesReady": ready, "pods": len(pods)}
