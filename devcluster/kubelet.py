"""A process-backed node: a kubelet that runs each container of the pods bound to its node as a local process, and
reports them through the public Kubernetes API only (so it also joins a real cluster).

Images are ignored: a container runs its `command` + `args` (an image's entrypoint is unknown here, so a container
without `command` waits with `CreateContainerConfigError`) from this machine's environment: the kubelet's own
environment variables (less KUBECONFIG), then the service link variables, then `HOSTNAME` (the pod's name) and
`POD_IP`, then the container's `envFrom` and `env` (podenv.py: the downward API, ConfigMaps, Secrets, `$(NAME)`
references, which may name service link variables). Volumes are folders of this machine, paths under a mount in
the environment and the command line rewritten to them (volumes.py: Secret, ConfigMap, emptyDir and hostPath
volumes). Security contexts, resource limits and hooks are not applied. Each process starts in its own session and
process group (and, for a pod that mounts its ServiceAccount, mount namespace: below); when the main process
exits, what is left of its group is killed, as a container's processes die with its PID 1.

- Node: registered with its capacity (nodes.py), then kept Ready by heartbeats: its Lease in `kube-node-lease`
  renewed every `lease_interval`, its status every `status_interval`. On `shutdown()` its processes are stopped and
  the node reports Ready=Unknown (a real node gets that from the node lifecycle controller once its Lease expires).
- Pod IP: one loopback address per pod from the node's pod CIDR (127.0.N.0/24), in `status.podIP` and `POD_IP`.
- Service links, as a kubelet sets them unless the pod's `enableServiceLinks` is false: for each Service of the
  pod's namespace (read as the container starts) with a cluster IP, `NAME_SERVICE_HOST`, `NAME_SERVICE_PORT` (and
  `NAME_SERVICE_PORT_PORTNAME` per named port), `NAME_PORT=tcp://IP:PORT` and per port `NAME_PORT_PORT_TCP`,
  `..._PROTO`, `..._PORT`, `..._ADDR` (NAME upper-cased, `-` as `_`); and always `KUBERNETES_SERVICE_HOST`,
  `KUBERNETES_SERVICE_PORT` and their link variables, naming the API server this kubelet talks to. The local API
  server allocates no cluster IPs, so a Service without one is named by an address of `SERVICE_LINK_RANGE`
  (198.18.0.0/15, reserved for benchmarks and routed nowhere) derived from its namespace and name: it only fills
  the variables, no traffic reaches it. A headless (`clusterIP: None`) or ExternalName Service gets no variables.
- Status (podstatus.py): phase, conditions, `containerStatuses` (state, lastState, restartCount, ready, started,
  `containerID` `process://PID`), written when it changes (a merge patch of `pods/NAME/status`).
- Probes (probes.py): a startup probe gates the others, a failing readiness probe makes the container unready, a
  failing liveness or startup probe kills it; a container without a readiness probe is ready while it runs.
- Restarts: `restartPolicy` Always, OnFailure or Never, with back-off (`Backoff`: 10 s doubling to 300 s by
  default); init containers run one after the other first, each until it succeeds.
- Deletion: once the pod has a `deletionTimestamp`, SIGTERM to every container's process group, SIGKILL to what is
  left after the pod's grace period, a last status, then the pod is deleted with `gracePeriodSeconds: 0`.
- ServiceAccount, as a kubelet mounts it unless the pod (or else its ServiceAccount) sets
  `automountServiceAccountToken: false`: a token of the pod's `serviceAccountName` (`default` when unset), bound to
  the pod (a TokenRequest, `token_seconds` long, requested again once 80% of its life has passed; a failed request
  keeps the container waiting with `CreateContainerConfigError`), the API's CA (the kubeconfig's; empty when the
  API is plain HTTP) and the namespace, as files `token`, `ca.crt` and `namespace` of `STATE/pods/UID/
  serviceaccount`. Each container runs in a mount namespace of its own (`unshare --mount`, private propagation),
  that folder mounted read-only on /var/run/secrets/kubernetes.io/serviceaccount (a replaced token shows through)
  and the machine's ~/.kube hidden, so that `kubernetes.config.load_incluster_config()` works unchanged in a pod,
  with `KUBERNETES_SERVICE_HOST`/`PORT` (above). The mount point is made on this machine once (an empty folder).
  Where mount namespaces cannot be had (not root, no `unshare`), the kubelet says why once and a path under that
  folder in a container's command, arguments or environment is rewritten, as for volumes. A container never gets
  the kubelet's `KUBECONFIG`. (Exec probes run outside the mount namespace.)
- Logs: stdout and stderr of each run of a container go to `STATE/logs/NS_POD_UID/CONTAINER/RESTART.log` (kept
  after the pod goes); `pod_log()` reads them. Each pod's working directory is `STATE/pods/UID` (removed with the
  pod).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import hashlib
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from . import podenv, probes, volumes
from .aiokube import ApiError, Informer, KubeClient, Obj
from .nodes import LEASE_NAMESPACE, NodeConfig, build_lease, build_node, micro_time, next_pod_ip, node_status, timestamp
from .podstatus import Backoff, ContainerView, exit_code_of, pod_status, should_restart, terminated

log = logging.getLogger(__name__)

_API_ERRORS = (ApiError, aiohttp.ClientError, TimeoutError)
SERVICE_LINK_RANGE = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544's benchmarking range: routed nowhere
#: where a container finds its ServiceAccount's token, the API's CA and its namespace (what in-cluster clients read)
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
#: run in the container's own mount namespace before its command: the pod's ServiceAccount folder ($1) mounted
#: read-only on SERVICE_ACCOUNT_DIR ($2), the machine's ~/.kube hidden (a container never sees the node's
#: kubeconfig, which the Kubernetes clients would prefer to the in-cluster one), then the command itself
_MOUNT_SCRIPT = ('mount --bind -o ro "$1" "$2" || exit 1; '
                 'if [ -d "$HOME/.kube" ]; then mount -t tmpfs -o ro,mode=0755 tmpfs "$HOME/.kube" || exit 1; fi; '
                 'shift 2; exec "$@"')


@dataclass(frozen=True)
class KubeletConfig:
    state_dir: Path
    backoff: Backoff = field(default_factory=Backoff)
    lease_interval: float = 10.0
    lease_duration: int = 40
    status_interval: float = 60.0
    stop_grace: float = 5.0  # seconds a process gets between SIGTERM and SIGKILL when the kubelet stops
    retry_delay: float = 1.0  # between attempts at an API call that failed
    host_ip: str = "127.0.0.1"
    base_env: Mapping[str, str] | None = None  # the processes' base environment; None: the kubelet's own
    token_seconds: int = 3607  # expirationSeconds of the pods' ServiceAccount tokens (a kubelet's own default)
    mount_namespaces: bool = True  # False: never run containers in mount namespaces of their own


def _now() -> str:
    return timestamp(datetime.datetime.now(datetime.UTC))


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(parent pid, process group, start time in clock ticks) of a live process, from /proc; None when gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, session, ...
    return int(fields[1]), int(fields[2]), int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """Every live descendant of `root` (pid -> start time), its children's new sessions included."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _proc_stat(int(entry))) is not None:
            children.setdefault(stat[0], []).append((int(entry), stat[2]))
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid, started in children.get(todo.pop(), []):
            if pid not in found:
                found[pid] = started
                todo.append(pid)
    return found


def mount_namespace_problem() -> str | None:
    """Why this machine cannot give containers a mount namespace of their own with their ServiceAccount mounted
    (not root, no `unshare`, the mount point cannot be made, the kernel refuses); None when it can. Found once, by
    trying, and logged once when it cannot (the nodes of a cluster ask together, from their threads). The mount
    point, an empty folder, is made on this machine."""
    with _PROBE_LOCK:
        return _probe_mount_namespaces()


_PROBE_LOCK = threading.Lock()


@functools.cache
def _probe_mount_namespaces() -> str | None:
    problem = None
    if os.geteuid() != 0:
        problem = "the kubelet does not run as root"
    elif missing := [tool for tool in ("unshare", "mount", "sh") if shutil.which(tool) is None]:
        problem = f"{', '.join(missing)} not found"
    else:
        try:
            os.makedirs(SERVICE_ACCOUNT_DIR, exist_ok=True)
            tried = subprocess.run(["unshare", "--mount", "--propagation", "private", "mount", "--bind", "-o", "ro",
                                    SERVICE_ACCOUNT_DIR, SERVICE_ACCOUNT_DIR], capture_output=True, text=True,
                                   timeout=10, check=False)
            if tried.returncode:
                problem = f"unshare --mount failed: {tried.stderr.strip() or tried.returncode}"
        except (OSError, subprocess.SubprocessError) as e:
            problem = f"{SERVICE_ACCOUNT_DIR}: {e}"
    if problem is not None:
        log.warning("containers run without a mount namespace of their own (%s): their ServiceAccount token is not "
                    "at %s, so in-cluster clients do not find it; a path under it in a container's command, "
                    "arguments or environment is rewritten to the pod's folder, as other volumes are", problem,
                    SERVICE_ACCOUNT_DIR)
    return problem


def service_address(service: Obj) -> str | None:
    """The address a Service's link variables name: its clusterIP; for one without (the local API server allocates
    none), an address of SERVICE_LINK_RANGE derived from its namespace and name, the same on every node; None for a
    headless or ExternalName Service, which gets no variables."""
    spec = service.get("spec") or {}
    if spec.get("clusterIP") == "None" or spec.get("type") == "ExternalName":
        return None
    if spec.get("clusterIP"):
        return str(spec["clusterIP"])
    metadata = service.get("metadata") or {}
    digest = hashlib.sha256(f"{metadata.get('namespace')}/{metadata.get('name')}".encode()).digest()
    return str(SERVICE_LINK_RANGE[1 + int.from_bytes(digest[:4], "big") % (SERVICE_LINK_RANGE.num_addresses - 2)])


def _link_name(name: str) -> str:
    return name.upper().replace("-", "_")


def service_variables(name: str, address: str, ports: list[Obj]) -> dict[str, str]:
    """The variables a kubelet gives a pod for one Service at this address (Docker links' names)."""
    prefix = _link_name(name)
    env = {f"{prefix}_SERVICE_HOST": address}
    if ports:
        env[f"{prefix}_SERVICE_PORT"] = str(ports[0].get("port"))
    env.update({f"{prefix}_SERVICE_PORT_{_link_name(str(p['name']))}": str(p.get("port")) for p in ports
                if p.get("name")})
    host = f"[{address}]" if ":" in address else address
    for index, port in enumerate(ports):
        protocol = str(port.get("protocol") or "TCP")
        url = f"{protocol.lower()}://{host}:{port.get('port')}"
        if index == 0:
            env[f"{prefix}_PORT"] = url
        at = f"{prefix}_PORT_{port.get('port')}_{protocol.upper()}"
        env.update({at: url, f"{at}_PROTO": protocol.lower(), f"{at}_PORT": str(port.get("port")),
                    f"{at}_ADDR": address})
    return env


def service_links(services: list[Obj], api_server: str) -> dict[str, str]:
    """The service link variables of a pod: those of these Services (its namespace's, or none when its
    `enableServiceLinks` is false), then `kubernetes`'s, which name the API server at this URL."""
    env: dict[str, str] = {}
    for service in services:
        address = service_address(service)
        if address is not None:
            env.update(service_variables(str(service["metadata"]["name"]), address,
                                         list((service.get("spec") or {}).get("ports") or [])))
    url = urllib.parse.urlsplit(api_server)
    https = url.scheme == "https"
    port = {"name": "https", "port": url.port or 443} if https else {"port": url.port or 80}
    env.update(service_variables("kubernetes", url.hostname or "", [port]))
    return env


def pod_log(state_dir: str | Path, namespace: str, name: str, container: str | None = None, *,
            previous: bool = False) -> str:
    """What a container of the pod printed in its current run (or the one before, with `previous`). The pod is
    the latest one of that name; `container` may be left out when the pod has one."""
    pods = sorted(Path(state_dir, "logs").glob(f"{namespace}_{name}_*"), key=lambda p: p.stat().st_mtime)
    if not pods:
        raise FileNotFoundError(f"no logs of pod {namespace}/{name} under {state_dir}")
    containers = sorted(d.name for d in pods[-1].iterdir() if d.is_dir())
    if container is None:
        if len(containers) != 1:
            raise ValueError(f"pod {namespace}/{name} has several containers: name one of {containers}")
        container = containers[0]
    runs = sorted(pods[-1].joinpath(container).glob("*.log"), key=lambda p: int(p.stem))
    if len(runs) < (2 if previous else 1):
        raise FileNotFoundError(f"no {'previous ' if previous else ''}log of container {container!r} of pod "
                                f"{namespace}/{name}")
    return runs[-2 if previous else -1].read_text(errors="replace")


class Kubelet:
    def __init__(self, client: KubeClient, node: NodeConfig, config: KubeletConfig) -> None:
        self.client, self.node, self.config = client, node, config
        self.pod_cidr = node.pod_cidr
        self.pods = Informer(client, "/api/v1/pods", self._pod_changed, field_selector=f"spec.nodeName={node.name}",
                             retry_delay=config.retry_delay)
        self.workers: dict[str, PodWorker] = {}
        self.ready = asyncio.Event()
        self._finished: set[str] = set()  # uids whose worker is done, until the pod's DELETED event
        self._stopping = False
        self.lost = False  # powered off (`lose`): silent for good
        self._node_uid = ""
        self._node_status: Mapping[str, Any] | None = None
        self._last_ip: str | None = None
        self.mounts = False  # whether containers get mount namespaces (mount_namespace_problem), known once running

    @property
    def name(self) -> str:
        return self.node.name

    async def run(self) -> None:
        if self.config.mount_namespaces:
            self.mounts = await asyncio.to_thread(mount_namespace_problem) is None
        await self._register()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.pods.run())
            tasks.create_task(self._heartbeat(self.config.lease_interval, self._renew_lease))
            tasks.create_task(self._heartbeat(self.config.status_interval, self._post_status))
            await self.pods.synced.wait()
            self.ready.set()

    async def lose(self) -> None:
        """The node powered off: every process it started killed at once (SIGKILL, no grace), and nothing written
        to the API from now on (no status, no Lease, no deletion): the pods stay in the API as they were, until
        the node lifecycle controller finds the node lost."""
        self._stopping = self.lost = True
        workers = list(self.workers.values())
        for worker in workers:
            worker.in_api = False  # its last status is never written
            for container in (*worker.init, *worker.main):
                if container.process is not None and container.process.returncode is None:
                    container.signal(signal.SIGKILL)
            worker.request_stop(0, leave_pod=True)
        await asyncio.gather(*(w.done.wait() for w in workers))

    async def shutdown(self) -> None:
        """Stop every process this node started (SIGTERM, then SIGKILL after `stop_grace`) and report the node
        not ready. Pods stay in the API as they are."""
        if self.lost:
            return
        self._stopping = True
        workers = list(self.workers.values())
        for worker in workers:
            worker.request_stop(self.config.stop_grace, leave_pod=True)
        await asyncio.gather(*(w.done.wait() for w in workers))
        with contextlib.suppress(*_API_ERRORS):
            async with asyncio.timeout(2.0):
                await self._post_status(ready=False)

    # -- node -------------------------------------------------------------------------------------------------

    async def _register(self) -> None:
        while True:
            try:
                node = await self._create_or_update_node()
                self._node_uid = node["metadata"]["uid"]
                self.pod_cidr = (node.get("spec") or {}).get("podCIDR") or self.node.pod_cidr
                await self._post_status(previous=node.get("status"))
                await self._renew_lease()
                return
            except _API_ERRORS as e:
                log.warning("node %s: registration failed (%s); retrying", self.name, e)
                await asyncio.sleep(self.config.retry_delay)

    async def _create_or_update_node(self) -> Obj:
        body = build_node(self.node)
        try:
            created: Obj = await self.client.create("/api/v1/nodes", body)
            return created
        except ApiError as e:
            if e.status != 409:
                raise
        updated: Obj = await self.client.patch(f"/api/v1/nodes/{self.name}",
                                               {"metadata": {"labels": body["metadata"]["labels"]}})
        return updated

    async def _post_status(self, previous: Mapping[str, Any] | None = None, *, ready: bool = True) -> None:
        status = node_status(self.node, ready=ready, now=datetime.datetime.now(datetime.UTC),
                             previous=previous or self._node_status)
        await self.client.patch(f"/api/v1/nodes/{self.name}/status", {"status": status})
        self._node_status = status

    async def _renew_lease(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases/{self.name}"
        now = datetime.datetime.now(datetime.UTC)
        try:
            await self.client.patch(path, {"spec": {"holderIdentity": self.name, "renewTime": micro_time(now)}})
        except ApiError as e:
            if e.status != 404:
                raise
            lease = build_lease(self.name, self._node_uid, duration=self.config.lease_duration, now=now)
            await self.client.create(f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NAMESPACE}/leases", lease)

    async def _heartbeat(self, interval: float, beat: Any) -> None:
        while True:
            await asyncio.sleep(interval)  # the heartbeat's own pace
            try:
                await beat()
            except _API_ERRORS as e:
                log.warning("node %s: heartbeat failed: %s", self.name, e)

    # -- pods -------------------------------------------------------------------------------------------------

    def _pod_changed(self, kind: str, pod: Obj) -> None:
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if kind == "DELETED":
            self._finished.discard(uid)
            if worker is not None:
                worker.gone()
            return
        if worker is not None:
            worker.update(pod)
        elif uid not in self._finished and not self._stopping:
            worker = self.workers[uid] = PodWorker(self, pod, self._allocate_ip(pod))
            worker.start()

    def _worker_done(self, worker: PodWorker) -> None:
        self.workers.pop(worker.uid, None)
        if worker.in_api:
            self._finished.add(worker.uid)

    def _allocate_ip(self, pod: Obj) -> str:
        held = {w.ip for w in self.workers.values() if w.holds_ip}
        held |= {str(p["status"]["podIP"]) for p in self.pods.objects.values()
                 if (p.get("status") or {}).get("podIP") and p["status"].get("phase") not in ("Succeeded", "Failed")
                 and p["metadata"]["uid"] != pod["metadata"]["uid"]}
        known = (pod.get("status") or {}).get("podIP")
        if known and known not in held and ipaddress.ip_address(known) in ipaddress.ip_network(self.pod_cidr):
            return str(known)
        self._last_ip = next_pod_ip(self.pod_cidr, held, self._last_ip)
        return self._last_ip

    def log_path(self, pod: Obj, container: str, restart: int) -> Path:
        metadata = pod["metadata"]
        return Path(self.config.state_dir, "logs", f"{metadata['namespace']}_{metadata['name']}_{metadata['uid']}",
                    container, f"{restart}.log")

    def work_dir(self, uid: str) -> Path:
        return Path(self.config.state_dir, "pods", uid)


@dataclass
class _Container:
    """What the node knows of one container: its spec, its current process and the states it reports."""

    spec: Obj
    init: bool = False
    restart_count: int = 0
    backoff_step: int = 0
    process: asyncio.subprocess.Process | None = None
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    container_id: str = ""
    # the descendants of the container's process seen when it was signalled (pid -> start time): those that left
    # its process group (a server that makes a session of its own, as vLLM's does) die with the SIGKILL too, as
    # every process of a container's cgroup does
    descendants: dict[int, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    def signal(self, sig: signal.Signals) -> None:
        """Signal the container's process group; with SIGKILL, every descendant seen since it started too."""
        if self.process is None:
            return
        if self.process.returncode is None:
            self.descendants.update(_descendants(self.process.pid))
        _signal_group(self.process.pid, sig)
        if sig == signal.SIGKILL:
            for pid, started in self.descendants.items():
                stat = _proc_stat(pid)
                if stat is not None and stat[2] == started:  # (not a later process under a reused pid)
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, signal.SIGKILL)
            self.descendants.clear()

    def view(self) -> ContainerView:
        return ContainerView(name=self.name, image=str(self.spec.get("image") or ""), state=self.state,
                             last_state=self.last_state, ready=self.ready, started=self.started,
                             restart_count=self.restart_count, container_id=self.container_id)


class PodWorker:
    """Runs one pod on the node from its binding to its deletion."""

    def __init__(self, kubelet: Kubelet, pod: Obj, ip: str) -> None:
        self.kubelet, self.pod, self.ip = kubelet, pod, ip
        self.uid = str(pod["metadata"]["uid"])
        spec = pod.get("spec") or {}
        self.init = [_Container(c, init=True) for c in spec.get("initContainers") or []]
        self.main = [_Container(c) for c in spec.get("containers") or []]
        for container in self.main:
            container.restart_count = _previous_restarts(pod, container.name)
        self.start_time = str((pod.get("status") or {}).get("startTime") or _now())
        self.holds_ip = (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        self.in_api = True
        self.done = asyncio.Event()
        self._stop = asyncio.Event()
        self._grace: float | None = None
        self._leave_pod = False
        self._dirty = asyncio.Event()
        self._published: dict[str, Any] | None = None
        self._task: asyncio.Task[None] | None = None
        self._account: Path | None = None  # the pod's ServiceAccount folder (None: it mounts none)
        self._account_known = False  # whether _account is decided (and written)
        self._account_lock = asyncio.Lock()  # the pod's containers start together: one token request
        self._refresher: asyncio.Task[None] | None = None  # keeps its token fresh

    @property
    def client(self) -> KubeClient:
        return self.kubelet.client

    @property
    def path(self) -> str:
        return f"/api/v1/namespaces/{self.pod['metadata']['namespace']}/pods/{self.pod['metadata']['name']}"

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"pod {self.path}")
        self._task.add_done_callback(self._finished)
        self.update(self.pod)

    def _finished(self, _: asyncio.Task[None]) -> None:
        self.done.set()
        self.kubelet._worker_done(self)

    def update(self, pod: Obj) -> None:
        self.pod = pod
        metadata = pod["metadata"]
        if metadata.get("deletionTimestamp"):
            grace = metadata.get("deletionGracePeriodSeconds")
            self.request_stop(float(grace if grace is not None else _grace_of(pod)))

    def request_stop(self, grace: float | None, *, leave_pod: bool = False) -> None:
        """Stop the pod's processes within `grace` seconds (None: the pod's grace period); `leave_pod` skips the
        last status and the deletion (the pod is gone, or the node is stopping)."""
        self._leave_pod = self._leave_pod or leave_pod
        grace = _grace_of(self.pod) if grace is None else grace
        self._grace = grace if self._grace is None else min(self._grace, grace)
        self._stop.set()

    def gone(self) -> None:
        """The pod is no longer in the API (deleted at once, e.g. `--force --grace-period=0`)."""
        self.in_api = False
        self.request_stop(None, leave_pod=True)

    # -- the pod's life -----------------------------------------------------------------------------------------

    async def _run(self) -> None:
        publisher = asyncio.create_task(self._publish_loop())
        phase = (self.pod.get("status") or {}).get("phase")
        life = asyncio.create_task(self._live() if phase not in ("Succeeded", "Failed") else asyncio.sleep(0))
        try:
            await self._stop.wait()
            await self._terminate(life)
        finally:
            life.cancel()
            if self._refresher is not None:
                self._refresher.cancel()
            for container in (*self.init, *self.main):  # never leave a process behind, even when cancelled
                if container.process is not None and container.process.returncode is None:
                    container.signal(signal.SIGKILL)
            publisher.cancel()
            self.holds_ip = False
        if not self._leave_pod:
            with contextlib.suppress(*_API_ERRORS):
                await self._publish(terminating=True)
                await self.client.delete(self.path, {"apiVersion": "v1", "kind": "DeleteOptions",
                                                     "gracePeriodSeconds": 0, "preconditions": {"uid": self.uid}})
            shutil.rmtree(self.kubelet.work_dir(self.uid), ignore_errors=True)

    async def _live(self) -> None:
        self._dirty.set()
        for container in self.init:
            await self._keep_running(container)
            if container.view().exit_code != 0:
                return
        await asyncio.gather(*(self._keep_running(c) for c in self.main))
        self.holds_ip = False

    async def _terminate(self, life: asyncio.Task[None]) -> None:
        for container in (*self.init, *self.main):
            container.signal(signal.SIGTERM)
        await asyncio.wait([life], timeout=self._grace)
        for container in (*self.init, *self.main):
            container.signal(signal.SIGKILL)
        await asyncio.wait([life])

    async def _keep_running(self, container: _Container) -> None:
        """Run the container, restarting it as its restart policy says, until it is done or the pod stops."""
        policy = (self.pod.get("spec") or {}).get("restartPolicy") or "Always"
        backoff = self.kubelet.config.backoff
        while not self._stop.is_set():
            try:
                env, argv = await self._prepare(container)
            except podenv.EnvError as e:
                container.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(e)}}
                self._dirty.set()
                await self._pause(backoff.delay(container.backoff_step))
                container.backoff_step += 1
                continue
            if self._stop.is_set():
                return
            started = datetime.datetime.now(datetime.UTC)
            exit_state = await self._run_once(container, env, argv)
            ran = (datetime.datetime.now(datetime.UTC) - started).total_seconds()
            container.backoff_step = 0 if ran >= backoff.reset else container.backoff_step
            if self._stop.is_set() or not should_restart(policy, exit_state["exitCode"], init=container.init):
                container.state = {"terminated": exit_state}
                container.ready = container.init and exit_state["exitCode"] == 0
                self._dirty.set()
                return
            delay = backoff.delay(container.backoff_step)
            container.backoff_step += 1
            container.last_state = {"terminated": exit_state}
            meta = self.pod["metadata"]
            container.state = {"waiting": {"reason": "CrashLoopBackOff", "message": (
                f"back-off {delay:g}s restarting failed container={container.name} "
                f"pod={meta['name']}_{meta['namespace']}({self.uid})")}}
            self._dirty.set()
            if await self._pause(delay):
                container.state, container.last_state = {"terminated": exit_state}, {}
                self._dirty.set()
                return
            container.restart_count += 1

    async def _pause(self, seconds: float) -> bool:
        """Wait out a back-off; True when the pod stops meanwhile."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):  # not wait_for: on 3.11 it can swallow a cancellation
                await self._stop.wait()
        return self._stop.is_set()

    async def _prepare(self, container: _Container) -> tuple[dict[str, str], list[str]]:
        namespace = self.pod["metadata"]["namespace"]
        configmap_names, secret_names = podenv.sources(container.spec)
        volume_configmaps, volume_secrets = volumes.sources(self.pod)
        configmaps = {n: podenv.configmap_data(await self._fetch(f"/api/v1/namespaces/{namespace}/configmaps/{n}"))
                      for n in configmap_names | volume_configmaps}
        secrets = {n: podenv.secret_data(await self._fetch(f"/api/v1/namespaces/{namespace}/secrets/{n}"))
                   for n in secret_names | volume_secrets}
        mounts = volumes.prepare(self.pod, container.spec, self.kubelet.work_dir(self.uid) / "volumes",
                                 configmaps=configmaps, secrets=secrets)
        account = await self._service_account()
        if account is not None and not self.kubelet.mounts:
            mounts[SERVICE_ACCOUNT_DIR] = str(account)  # no mount namespace: the path is rewritten, as volumes are
        links = await self._service_links()
        own = podenv.container_env(self.pod, container.spec, pod_ip=self.ip, host_ip=self.kubelet.config.host_ip,
                                   configmaps=configmaps, secrets=secrets, node_allocatable=self.kubelet.node.capacity,
                                   services=links)
        pod_env = {k: volumes.rewrite(v, mounts)
                   for k, v in {**links, "HOSTNAME": self.pod["metadata"]["name"], "POD_IP": self.ip, **own}.items()}
        base = self.kubelet.config.base_env
        # a container never sees the node's kubeconfig: the clients in it would prefer it to the in-cluster one
        env = {**{k: v for k, v in (os.environ if base is None else base).items() if k != "KUBECONFIG"}, **pod_env}
        argv = [volumes.rewrite(part, mounts) for part in podenv.command_line(container.spec, pod_env)]
        if account is not None and self.kubelet.mounts and shutil.which(argv[0], path=env.get("PATH")):
            # (a command that is not found is left as it is, to fail to start as it does without the wrapper)
            argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _MOUNT_SCRIPT, "sh",
                    str(account), SERVICE_ACCOUNT_DIR, *argv]
        return env, argv

    # -- the ServiceAccount -----------------------------------------------------------------------------------------

    async def _service_account(self) -> Path | None:
        """The pod's ServiceAccount folder (`token`, `ca.crt`, `namespace`), what a kubelet mounts at
        SERVICE_ACCOUNT_DIR, written on the first call with a token bound to the pod and kept fresh from then on;
        None when the pod (or else its ServiceAccount) sets `automountServiceAccountToken: false`."""
        async with self._account_lock:
            if not self._account_known:
                self._account = await self._mount_service_account()
                self._account_known = True
            return self._account

    async def _mount_service_account(self) -> Path | None:
        spec, namespace = self.pod.get("spec") or {}, str(self.pod["metadata"]["namespace"])
        name = str(spec.get("serviceAccountName") or spec.get("serviceAccount") or "default")
        automount = spec.get("automountServiceAccountToken")
        if automount is None:
            account = await self._fetch(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}")
            if account is None:
                raise podenv.EnvError(f'serviceaccount "{name}" not found')
            automount = account.get("automountServiceAccountToken")
        if automount is False:
            return None
        folder = self.kubelet.work_dir(self.uid) / "serviceaccount"
        folder.mkdir(parents=True, exist_ok=True)
        token, lifetime = await self._request_token(name)
        _write_file(folder / "ca.crt", self.client.endpoint.ca_pem or b"")  # none: the API is not served over TLS
        _write_file(folder / "namespace", namespace.encode())
        _write_file(folder / "token", token.encode())
        self._refresher = asyncio.create_task(self._refresh_token(folder / "token", name, lifetime),
                                              name=f"token of {self.path}")
        return folder

    async def _request_token(self, account: str) -> tuple[str, float]:
        """A token of the ServiceAccount bound to this pod (a TokenRequest), and the seconds it is valid for."""
        namespace = self.pod["metadata"]["namespace"]
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "spec": {"expirationSeconds": self.kubelet.config.token_seconds,
                         "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": self.pod["metadata"]["name"],
                                            "uid": self.uid}}}
        try:
            answer = await self.client.create(f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token", body)
            status = answer["status"]
            expires = datetime.datetime.fromisoformat(str(status["expirationTimestamp"]).replace("Z", "+00:00"))
        except (*_API_ERRORS, KeyError, TypeError, ValueError) as e:
            raise podenv.EnvError(f"a token of serviceaccount {namespace}/{account}: {e}") from e
        return str(status["token"]), (expires - datetime.datetime.now(datetime.UTC)).total_seconds()

    async def _refresh_token(self, path: Path, account: str, lifetime: float) -> None:
        """Replace the token once 80% of its life has passed, as a kubelet does (the file is replaced whole, and
        the folder is what is mounted: a running container reads the new one); retried on failure."""
        delay, failures = 0.8 * lifetime, 0
        while True:
            await asyncio.sleep(max(delay, 0.0))  # the token's own schedule
            try:
                token, lifetime = await self._request_token(account)
            except podenv.EnvError as e:
                log.warning("pod %s: token not refreshed (%s); retrying", self.path, e)
                delay, failures = min(self.kubelet.config.retry_delay * 2 ** failures, 30.0), failures + 1
                continue
            _write_file(path, token.encode())
            delay, failures = 0.8 * lifetime, 0

    async def _service_links(self) -> dict[str, str]:
        """The pod's service link variables, from the Services of its namespace as they are now."""
        services: list[Obj] = []
        if (self.pod.get("spec") or {}).get("enableServiceLinks", True) is not False:
            listed = await self._fetch(f"/api/v1/namespaces/{self.pod['metadata']['namespace']}/services")
            services = list((listed or {}).get("items") or [])
        return service_links(services, self.client.endpoint.server)

    async def _fetch(self, path: str) -> Obj | None:
        try:
            found: Obj = await self.client.get(path)
            return found
        except ApiError as e:
            if e.status == 404:
                return None
            raise podenv.EnvError(f"{path}: {e}") from e
        except (aiohttp.ClientError, TimeoutError) as e:
            raise podenv.EnvError(f"{path}: {e}") from e

    async def _run_once(self, container: _Container, env: dict[str, str], argv: list[str]) -> dict[str, Any]:
        """Start the container's process, watch it until it exits, and return its terminated state."""
        started_at = _now()
        log_file = self.kubelet.log_path(self.pod, container.name, container.restart_count)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        work_dir = self.kubelet.work_dir(self.uid)
        work_dir.mkdir(parents=True, exist_ok=True)
        cwd = container.spec.get("workingDir") or str(work_dir)
        try:
            with open(log_file, "ab") as output:
                process = await asyncio.create_subprocess_exec(
                    *argv, stdin=asyncio.subprocess.DEVNULL, stdout=output, stderr=asyncio.subprocess.STDOUT,
                    env=env, cwd=cwd, start_new_session=True)
        except OSError as e:
            with open(log_file, "a") as output:
                output.write(f"failed to start {argv[0]!r}: {e}\n")
            return terminated(128, started_at=started_at, finished_at=_now(), container_id="", reason="StartError",
                              message=str(e))
        container.process, container.container_id = process, f"process://{process.pid}"
        if self._stop.is_set():  # stopped while starting: the signals may have missed this process
            _signal_group(process.pid, signal.SIGTERM)
        container.state = {"running": {"startedAt": started_at}}
        checks = probes.probes_of(container.spec) if not container.init else []
        container.started = not any(kind == "startupProbe" for kind, _ in checks)
        container.ready = not container.init and not any(kind == "readinessProbe" for kind, _ in checks)
        self._dirty.set()
        prober = asyncio.create_task(self._probe(container, process, env, cwd)) if checks else None
        try:
            returncode = await process.wait()
        finally:
            container.signal(signal.SIGKILL)  # the rest of the group dies with its leader, and what it left
            if prober is not None:
                prober.cancel()
        container.process, container.ready, container.started = None, False, False
        code = exit_code_of(returncode)
        return terminated(code, started_at=started_at, finished_at=_now(), container_id=container.container_id,
                          message=termination_message(container.spec, log_file, code))

    # -- probes -----------------------------------------------------------------------------------------------------

    async def _probe(self, container: _Container, process: asyncio.subprocess.Process, env: dict[str, str],
                     cwd: str) -> None:
        target = probes.Target(self.ip, probes.named_ports(container.spec), env, cwd)
        spec = container.spec
        if spec.get("startupProbe"):
            passed: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            startup = asyncio.create_task(probes.Prober(
                spec["startupProbe"], target, lambda ok: None if passed.done() else passed.set_result(ok)).run())
            try:
                if not await passed:
                    await self._kill(container, process, spec["startupProbe"])
                    return
            finally:
                startup.cancel()
            container.started = True
            self._dirty.set()

        def readiness(ok: bool) -> None:
            container.ready = ok
            self._dirty.set()

        async with asyncio.TaskGroup() as tasks:

            def liveness(ok: bool) -> None:
                if not ok:
                    tasks.create_task(self._kill(container, process, spec["livenessProbe"]))

            if spec.get("readinessProbe"):
                tasks.create_task(probes.Prober(spec["readinessProbe"], target, readiness).run())
            if spec.get("livenessProbe"):
                tasks.create_task(probes.Prober(spec["livenessProbe"], target, liveness).run())

    async def _kill(self, container: _Container, process: asyncio.subprocess.Process, probe: Obj) -> None:
        """Kill a container whose liveness or startup probe failed: SIGTERM, SIGKILL after the grace period."""
        grace = probe.get("terminationGracePeriodSeconds")
        container.signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(float(grace if grace is not None else _grace_of(self.pod))):
                await process.wait()
        container.signal(signal.SIGKILL)

    # -- status -------------------------------------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._publish()
            except _API_ERRORS as e:
                log.warning("pod %s: status not written (%s); retrying", self.path, e)
                asyncio.get_running_loop().call_later(self.kubelet.config.retry_delay, self._dirty.set)

    async def _publish(self, *, terminating: bool = False) -> None:
        status = pod_status(self.pod, [c.view() for c in self.init], [c.view() for c in self.main], pod_ip=self.ip,
                            host_ip=self.kubelet.config.host_ip, start_time=self.start_time, now=_now(),
                            terminating=terminating)
        if status == self._published or not self.in_api:
            return
        try:
            # A merge patch replaces the lists whole: `status` carries every condition, the others' included.
            await self.client.patch(f"{self.path}/status", {"metadata": {"uid": self.uid}, "status": status})
        except ApiError as e:
            if e.status != 404:
                raise
            self.in_api = False
            return
        self._published = status


def _write_file(path: Path, data: bytes) -> None:
    """Replace a file whole (a reader sees the old content or the new one, never a part)."""
    partial = path.with_name(f".{path.name}.tmp")
    partial.write_bytes(data)
    os.chmod(partial, 0o644)
    os.replace(partial, path)


def _grace_of(pod: Obj) -> float:
    grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds")
    return float(30 if grace is None else grace)


def _previous_restarts(pod: Obj, name: str) -> int:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return int(next((s.get("restartCount") or 0 for s in statuses if s.get("name") == name), 0))


TERMINATION_LOG_BYTES = 2048  # a kubelet's cap on a termination message taken from the log ...
TERMINATION_LOG_LINES = 80  # ... and on its lines


def termination_message(spec: dict[str, Any], log_file: Path, exit_code: int) -> str:
    """The container's termination message as a kubelet writes it into its terminated state: with
    `terminationMessagePolicy: FallbackToLogsOnError`, a failed container's last 80 lines of log, at most 2048
    bytes. (The file at terminationMessagePath is not read: a process-backed container has no /dev of its own.)"""
    if exit_code == 0 or spec.get("terminationMessagePolicy") != "FallbackToLogsOnError":
        return ""
    try:
        with open(log_file, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TERMINATION_LOG_BYTES))
            tail = f.read()
    except OSError:
        return ""
    lines = tail.decode(errors="replace").splitlines()[-TERMINATION_LOG_LINES:]
    return "\n".join(lines).strip()
