"""A whole local Kubernetes for the operator: API server, process-backed nodes, the CRD, and `shardwise operator`
as a child process — what `make demo`, the operator tests and the benchmarks drive through kubectl.

    with LocalSession(state_dir, nodes=2, gpus_per_node=4) as s:
        s.kubectl("apply", "-f", "examples/tiny-moe.yaml")
        s.wait_for(lambda: s.condition("tiny-moe", "Available") == "True", 300, "tiny-moe Available")

The operator runs as its own process (its own session and process group), started and stopped by PID; killing it
(`kill_operator`) and starting another is how a crash is exercised; with `operator=False` none runs (a test installs
the chart's, which runs as a pod). kubectl, the operator process and the nodes connect as the admin over HTTPS
(the kubeconfig the API server writes); an API outage (`api_down`, `api_up`) keeps the server's ports and
credentials, as a restarted API server keeps its certificates. Everything stops on exit.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .aiokube import load_kubeconfig
from .apiserver import APIServer
from .auth import Credentials
from .cluster import Cluster, process_env

CRD_FILE = "crds/inferencedeployments.shardwise.io.yaml"


class TimedOut(AssertionError):
    pass


def shardwise_command() -> list[str]:
    script = Path(sys.executable).parent / "shardwise"
    return [str(script)] if script.exists() else [shutil.which("shardwise") or "shardwise"]


class LocalSession:
    def __init__(self, state_dir: str | Path, *, nodes: int = 2, gpus_per_node: int = 4,
                 operator_args: tuple[str, ...] = (), operator_env: dict[str, str] | None = None,
                 crd: str | Path | None = None, prometheus: bool = False,
                 log: Callable[[str], None] | None = None, node_grace: float = 40.0, operator: bool = True) -> None:
        self.state_dir = Path(state_dir).absolute()  # the kubeconfig, the nodes' pods and logs are found from it
        self.node_grace = node_grace  # a node silent this long is found lost (Cluster.lose_node)
        self.nodes, self.gpus_per_node = nodes, gpus_per_node
        self.operator_args = operator_args
        self.with_operator = operator  # False: no `shardwise operator` process (the chart's runs as a pod instead)
        self.operator_env = dict(operator_env or {})  # the operator runs with the CLI's defaults otherwise
        self.crd = Path(crd) if crd else Path(__file__).resolve().parents[1] / CRD_FILE
        self.log = log or (lambda _: None)
        self.api: APIServer | None = None
        self._api_kept: dict[str, Any] | None = None  # while the API server is down (api_down): its objects
        self._api_ports = (0, 0)
        self._api_credentials: Credentials | None = None  # kept across api_down and api_up, as a server keeps its PKI
        self.cluster: Cluster | None = None
        self.kubeconfig = self.state_dir / "kubeconfig"
        self.operator: subprocess.Popen[bytes] | None = None
        self.operator_log = self.state_dir / "operator.log"
        self.with_prometheus = prometheus
        self.prometheus: Any = None
        self._targets_stop = threading.Event()
        self._targets: threading.Thread | None = None
        self._resources: dict[str, tuple[str, bool, str]] | None = None  # discovery: kind alias -> path parts

    # ------------------------------------------------------------------------------------ lifecycle
    def start(self) -> LocalSession:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.api = APIServer()
        url = self.api.start()
        self.api.write_kubeconfig(self.kubeconfig)  # the admin, over HTTPS: what kubectl and the nodes use
        self.cluster = Cluster(load_kubeconfig(self.kubeconfig), state_dir=self.state_dir / "nodes", nodes=self.nodes,
                               gpus_per_node=self.gpus_per_node, lease_interval=min(5.0, self.node_grace / 4),
                               status_interval=30.0, node_grace=self.node_grace)
        self.cluster.start()
        self.log(f"local cluster: API {url}, {self.nodes} nodes x {self.gpus_per_node} GPUs")
        self.kubectl("apply", "-f", str(self.crd))
        if self.with_prometheus:
            self._start_prometheus(url)
        if self.with_operator:
            self.start_operator()
        return self

    def _start_prometheus(self, api: str) -> None:
        """A real Prometheus scraping every running pod's `metrics` port (targets refreshed every second)."""
        from .dev import _metrics_targets
        from .prometheus import PrometheusServer

        self.prometheus = PrometheusServer(self.state_dir / "prometheus")
        self.prometheus.start()
        self.log(f"prometheus {self.prometheus.url}")

        def refresh() -> None:
            while not self._targets_stop.wait(1.0):
                with contextlib.suppress(Exception):  # the API may be stopping
                    self.prometheus.set_targets(*_metrics_targets(api))

        self._targets = threading.Thread(target=refresh, name="prometheus-targets", daemon=True)
        self._targets.start()

    def start_operator(self, *extra: str) -> subprocess.Popen[bytes]:
        assert self.operator is None or self.operator.poll() is not None, "the operator already runs"
        out = open(self.operator_log, "ab")  # noqa: SIM115 - the child owns it; closed when it is replaced
        self.operator = subprocess.Popen(
            [*shardwise_command(), "operator", "--kubeconfig", str(self.kubeconfig), *self.operator_args, *extra],
            stdout=out, stderr=subprocess.STDOUT, env={**process_env(), **self.operator_env}, start_new_session=True)
        out.close()
        self.log(f"operator started (pid {self.operator.pid})")
        return self.operator

    def api_outage(self, seconds: float) -> None:
        """The API server down for `seconds`, then started again on the same address with every object kept (as
        etcd keeps them) and no watch history: watches end, every client's calls fail meanwhile (the nodes',
        the operator's), and after it their watches resume or list again."""
        self.api_down()
        time.sleep(seconds)  # the outage itself
        self.api_up()

    def api_down(self) -> None:
        """Stop the API server, keeping its objects for `api_up` (an outage whose end a test chooses)."""
        assert self.api is not None and self._api_kept is None, "the session is not started, or the API is down"
        self._api_ports, self._api_credentials = (self.api.port, self.api.secure_port), self.api.credentials
        self.api.stop()
        self._api_kept = self.api.final_snapshot
        self.log("API server down")

    def api_up(self) -> None:
        """Start the API server stopped by `api_down` on the same address, with its objects and no watch history."""
        assert self._api_kept is not None, "the API server is not down"
        self.api = APIServer(port=self._api_ports[0], secure_port=self._api_ports[1],
                             credentials=self._api_credentials, restore=self._api_kept)
        self._api_kept = None
        self.api.start()
        self.log("API server back")

    @staticmethod
    def agent_pid(deployment: str, index: int) -> int:
        """The process of pod DEPLOYMENT-INDEX's agent (found by its environment: its ranks share it, not its
        command line), to inject a fault into; LookupError when there is none."""
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
                env = set((entry / "environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            if (b"agent" in cmd and any(c.endswith(b"shardwise") for c in cmd)
                    and f"SHARDWISE_DEPLOYMENT={deployment}".encode() in env
                    and f"SHARDWISE_POD_INDEX={index}".encode() in env):
                return int(entry.name)
        raise LookupError(f"no agent process for pod {deployment}-{index}")

    def kill_operator(self, sig: int = signal.SIGKILL) -> None:
        """Stop the operator process (SIGKILL: a crash; SIGTERM: a clean stop) and wait for it."""
        proc, self.operator = self.operator, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def stop(self) -> None:
        self.kill_operator(signal.SIGTERM)
        self._targets_stop.set()
        if self._targets is not None:
            self._targets.join(5)
        if self.prometheus is not None:
            self.prometheus.stop()
            self.prometheus = None
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
        if self.api is not None:
            self.api.stop()
            self.api = None

    def __enter__(self) -> LocalSession:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------------------------- clients
    def kubectl(self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60) -> str:
        """kubectl against the session's API: stdout (stderr too when check=False and it failed)."""
        done = subprocess.run(["kubectl", "--kubeconfig", str(self.kubeconfig), "--cache-dir",
                               str(self.state_dir / "kubectl-cache"), *args], capture_output=True, text=True,
                              input=input, timeout=timeout)
        if check and done.returncode:
            raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout if done.returncode == 0 else done.stdout + done.stderr

    def get(self, kind: str, name: str = "", namespace: str = "default") -> Any:
        """An object, or a list ({"items": [...]}) without `name`, as `kubectl get KIND [NAME] -o json` shows it;
        None when there is none or the API server does not answer. Read from the API over HTTP in this process:
        what a test observes costs no kubectl process (kubectl is for what a user does)."""
        try:
            return self._read(self._path(kind, name, namespace))
        except (OSError, http.client.HTTPException, ValueError):
            return None

    def status(self, name: str, namespace: str = "default") -> dict[str, Any]:
        obj = self.get("inferencedeployments.shardwise.io", name, namespace)
        return (obj or {}).get("status") or {}

    def wait_object(self, kind: str, name: str, check: Callable[[dict[str, Any]], Any], timeout: float, what: str,
                    namespace: str = "default") -> Any:
        """Wait, on a watch of the object, until `check(object)` is truthy (returned) or `timeout` passes
        (TimedOut names `what`). A watch the API server ends, or its outage, is followed by a fresh read and watch;
        while the server does not answer, its return is looked for every 0.2 s."""
        deadline = time.monotonic() + timeout
        base = self._path(kind, "", namespace)
        while True:
            try:
                listed = self._read(base, {"fieldSelector": f"metadata.name={name}"})
                items = listed.get("items") or []
                if items and (value := check(items[0])):
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                query = {"fieldSelector": f"metadata.name={name}", "watch": "true", "allowWatchBookmarks": "true",
                         "resourceVersion": str((listed.get("metadata") or {}).get("resourceVersion") or ""),
                         "timeoutSeconds": str(max(1, min(60, int(left) + 1)))}
                for event in self._watch(base, query, left + 10):
                    if event.get("type") in ("ADDED", "MODIFIED") and (value := check(event["object"])):
                        return value
                    if event.get("type") == "ERROR" or time.monotonic() > deadline:
                        break  # (410 Gone: read again)
            except (OSError, http.client.HTTPException, ValueError):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.2)  # the API server is down: polling for its return, not synchronising the test
            if time.monotonic() > deadline:
                break
        raise TimedOut(f"timed out after {timeout:.0f} s waiting for {what}")

    def _read(self, url_path: str, query: dict[str, str] | None = None) -> Any:
        assert self.api is not None
        url = self.api.url + url_path + ("?" + urllib.parse.urlencode(query) if query else "")
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise

    def _watch(self, url_path: str, query: dict[str, str], timeout: float) -> Iterator[dict[str, Any]]:
        assert self.api is not None
        url = self.api.url + url_path + "?" + urllib.parse.urlencode(query)
        with urllib.request.urlopen(url, timeout=timeout) as r:
            for line in r:
                if line.strip():
                    yield json.loads(line)

    def _path(self, kind: str, name: str, namespace: str) -> str:
        """The API path of KIND (a resource's plural, singular, kind or short name, optionally `.group`, as
        kubectl takes it), found through the API's discovery; NAME's, or the collection's."""
        if self._resources is None:
            found: dict[str, tuple[str, bool, str]] = {}
            groups = [("/api/v1", "")] + [
                (f"/apis/{g['preferredVersion']['groupVersion']}", g["name"])
                for g in (self._read("/apis") or {}).get("groups", [])]
            for prefix, group in groups:
                for r in (self._read(prefix) or {}).get("resources", []):
                    if "/" in r["name"]:
                        continue  # a subresource
                    for alias in {r["name"], r.get("singularName") or "", r["kind"].lower(), *r.get("shortNames", [])}:
                        if alias:
                            entry = (prefix + "/", bool(r["namespaced"]), str(r["name"]))
                            found.setdefault(alias, entry)
                            found.setdefault(f"{alias}.{group}", entry)
            self._resources = found
        known = self._resources.get(kind.lower())
        if known is None:
            self._resources = None  # (a CRD applied since: discovered again next time)
            raise ValueError(f"the API serves no resource {kind!r}")
        prefix, namespaced, plural = known
        where = f"namespaces/{namespace}/" if namespaced else ""
        return f"{prefix}{where}{plural}" + (f"/{name}" if name else "")

    def condition(self, name: str, type_: str, namespace: str = "default") -> str | None:
        for c in self.status(name, namespace).get("conditions") or []:
            if c.get("type") == type_:
                return str(c.get("status"))
        return None

    def pod_log(self, name: str, namespace: str = "default") -> str:
        assert self.cluster is not None
        return self.cluster.log(namespace, name)

    @staticmethod
    def wait_for(check: Callable[[], Any], timeout: float, what: str, *, interval: float = 0.5,
                 progress: Callable[[], str] | None = None, log: Callable[[str], None] | None = None) -> Any:
        """Poll `check` until it returns something truthy (returned) or `timeout` passes (TimedOut names `what`).
        With `progress`, each change of its text is passed to `log` (progress of long waits)."""
        deadline = time.monotonic() + timeout
        last = None
        while True:
            value = check()
            if value:
                return value
            if progress is not None and log is not None:
                text = progress()
                if text != last:
                    log(text)
                    last = text
            if time.monotonic() > deadline:
                raise TimedOut(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(interval)  # polling an outside process's state, not synchronising the test
