"""Process-backed nodes and the scheduler against any Kubernetes API, on one asyncio loop in a background thread.

    with APIServer() as server, Cluster(server.url, nodes=2, gpus_per_node=4, state_dir=tmp) as cluster:
        ...                                   # pods created through the API run as local processes
        print(cluster.log("default", "web"))  # what the pod's container printed

`start()` returns once every node is registered and Ready and the scheduler has seen the cluster; `stop()` stops
every process the nodes started (SIGTERM, SIGKILL after `stop_grace`) and reports the nodes not Ready. With the
scheduler runs the node lifecycle controller (nodelifecycle.py: a node silent for `node_grace` seconds is tainted
unreachable and its pods evicted); `lose_node(name)` is the fault it is for: a node powered off. The API is
a URL or an `Endpoint` (kube.load_kubeconfig). Node `i` is named `{node_prefix}-{i}` and hands out pod IPs from
`127.0.{first_subnet + i}.0/24`. Each node advertises this machine's CPUs plus one per GPU, and its memory, unless
told otherwise: the nodes share them, and a worker pod requests a CPU per GPU (operator/builders.py), which a GPU
node has to spare beside its other pods' CPUs. The state directory is made absolute when the cluster is made:
pod processes run in their own folders, and every path given to them (volumes, logs) derives from it. Given
the API as an HTTPS `Endpoint` that names its CA (a kubeconfig the local API server wrote), the nodes give each pod
that CA and a ServiceAccount token `token_seconds` long, mounted where in-cluster clients look (kubelet.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .aiokube import Endpoint, KubeClient
from .background import BackgroundLoop
from .deployments import DeploymentController
from .kubelet import Kubelet, KubeletConfig, pod_log
from .nodelifecycle import NodeLifecycle
from .nodes import NodeConfig
from .podstatus import Backoff
from .scheduler import SCHEDULER_NAMES, Scheduler
from .scheduling import GPU


def machine_memory() -> str:
    return f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') // 1024}Ki"


def node_configs(count: int, *, gpus_per_node: int, gpu_resource: str = GPU, cpu: str | None = None,
                 memory: str | None = None, max_pods: int = 110, node_prefix: str = "node", first_subnet: int = 1,
                 labels: Mapping[str, str] | None = None,
                 taints: Sequence[Mapping[str, str]] = ()) -> list[NodeConfig]:
    if first_subnet < 1 or first_subnet + count > 256:
        raise ValueError(f"pod subnets 127.0.{first_subnet}.0/24 to 127.0.{first_subnet + count - 1}.0/24 do not "
                         "fit in 127.0.1.0 to 127.0.255.0")
    cpus = (os.cpu_count() or 1) + gpus_per_node
    capacity = {"cpu": cpu or str(cpus), "memory": memory or machine_memory(), "pods": str(max_pods),
                gpu_resource: str(gpus_per_node)}
    return [NodeConfig(name=f"{node_prefix}-{i}", capacity=capacity, pod_cidr=f"127.0.{first_subnet + i}.0/24",
                       labels=dict(labels or {}), taints=tuple(taints)) for i in range(count)]


#: the interpreter an `engine: vllm` pod runs vLLM with (agents/vllm_engine.py); a user's value is kept
VLLM_PYTHON = "SHARDWISE_VLLM_PYTHON"
#: the environment `make install` builds for vLLM, apart from shardwise's so that vLLM's pins never reach it
VLLM_VENV = ".venv-vllm"


def vllm_python(roots: Sequence[Path] | None = None) -> str | None:
    """The interpreter of the vLLM environment `make install` built (ROOT/.venv-vllm/bin/python), or None. The
    roots, in order, by default: the project this package runs from (the repository of an editable install),
    the folder of the running interpreter's environment (`.venv` beside `.venv-vllm`), the working directory."""
    if roots is None:
        roots = [Path(__file__).resolve().parents[1], Path(sys.prefix).absolute().parent, Path.cwd()]
    for root in dict.fromkeys(r.absolute() for r in roots):
        python = root / VLLM_VENV / "bin" / "python"  # not resolved: a venv's python is a link out of the venv
        if os.access(python, os.X_OK):
            return str(python)
    return None


def process_env() -> dict[str, str]:
    """The base environment of pod processes: this one, with this interpreter's scripts first on PATH, so that a
    container command `shardwise ...` runs the same installation as the cluster (an image would provide it).

    An `engine: vllm` pod's image provides vLLM's `python3`; the local cluster pulls no image and runs every
    container as a process of this machine, where shardwise's environment has no vLLM. So the vLLM environment
    `make install` built (`vllm_python`) stands in for that image: its interpreter goes to the pods as
    SHARDWISE_VLLM_PYTHON, unless the variable is set already (an override, as the tests may give)."""
    scripts = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": os.pathsep.join([scripts, os.environ.get("PATH", "")])}
    if not env.get(VLLM_PYTHON) and (python := vllm_python()):
        env[VLLM_PYTHON] = python
    return env


class Cluster(BackgroundLoop):
    def __init__(self, api: str | Endpoint, *, state_dir: str | Path, nodes: int = 1, gpus_per_node: int = 8,
                 gpu_resource: str = GPU, cpu: str | None = None, memory: str | None = None, max_pods: int = 110,
                 node_prefix: str = "node", first_subnet: int = 1, labels: Mapping[str, str] | None = None,
                 taints: Sequence[Mapping[str, str]] = (), scheduler: bool = True,
                 scheduler_names: Sequence[str] = SCHEDULER_NAMES, backoff: Backoff | None = None,
                 lease_interval: float = 10.0, status_interval: float = 60.0, stop_grace: float = 5.0,
                 node_grace: float = 40.0, token_seconds: int = 3607) -> None:
        self.endpoint = api if isinstance(api, Endpoint) else Endpoint(server=api.rstrip("/"))
        self.state_dir = Path(state_dir).absolute()  # a relative one would move with each pod's working directory
        self.nodes = node_configs(nodes, gpus_per_node=gpus_per_node, gpu_resource=gpu_resource, cpu=cpu,
                                  memory=memory, max_pods=max_pods, node_prefix=node_prefix,
                                  first_subnet=first_subnet, labels=labels, taints=taints)
        self.kubelet_config = KubeletConfig(state_dir=self.state_dir, backoff=backoff or Backoff(),
                                            lease_interval=lease_interval, status_interval=status_interval,
                                            stop_grace=stop_grace, base_env=process_env(),
                                            token_seconds=token_seconds)
        self.with_scheduler, self.scheduler_names = scheduler, tuple(scheduler_names)
        self.node_grace = node_grace
        self._kubelets: dict[str, tuple[Kubelet, asyncio.Task[Any]]] = {}
        super().__init__()
        self.label = f"the nodes (API at {self.endpoint.server})"

    @property
    def node_names(self) -> list[str]:
        return [node.name for node in self.nodes]

    def start(self, timeout: float = 30.0) -> Cluster:
        self._start_thread(timeout, "devcluster-nodes")
        return self

    def lose_node(self, name: str, timeout: float = 30.0) -> None:
        """Power a node off: its processes killed at once, its kubelet silent from now on (no status, no Lease,
        no pod deletion confirmed). The pods stay in the API as they were until the node lifecycle controller
        finds the node lost, `node_grace` seconds later."""
        if self._loop is None or name not in self._kubelets:
            raise KeyError(f"no running node {name!r} (nodes: {self.node_names})")
        asyncio.run_coroutine_threadsafe(self._lose(name), self._loop).result(timeout)

    async def _lose(self, name: str) -> None:
        kubelet, run = self._kubelets[name]
        await kubelet.lose()
        run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await run

    def log(self, namespace: str, name: str, container: str | None = None, *, previous: bool = False) -> str:
        """What a pod's container printed (see kubelet.pod_log)."""
        return pod_log(self.state_dir, namespace, name, container, previous=previous)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _main(self) -> None:
        async with KubeClient(self.endpoint) as client:
            kubelets = [Kubelet(client, node, self.kubelet_config) for node in self.nodes]
            scheduler = Scheduler(client, scheduler_names=self.scheduler_names) if self.with_scheduler else None
            runs: list[asyncio.Task[Any]] = [asyncio.create_task(k.run()) for k in kubelets]
            self._kubelets = {k.name: (k, run) for k, run in zip(kubelets, runs, strict=True)}
            if scheduler is not None:
                runs.append(asyncio.create_task(scheduler.run()))
                runs.append(asyncio.create_task(NodeLifecycle(client, grace=self.node_grace).run()))
                runs.append(asyncio.create_task(DeploymentController(client).run()))
            waits = [k.ready.wait() for k in kubelets] + ([scheduler.wait_synced()] if scheduler else [])
            ready = asyncio.create_task(_all(waits))
            stopping = asyncio.create_task(self._stopped())
            try:
                await asyncio.wait([ready, stopping, *runs], return_when=asyncio.FIRST_COMPLETED)
                for run in runs:
                    if run.done():
                        run.result()  # a node or the scheduler failed: raise its error
                self._mark_ready()
                await stopping
            finally:
                ready.cancel()
                stopping.cancel()
                await asyncio.gather(*(k.shutdown() for k in kubelets), return_exceptions=True)
                for run in runs:
                    run.cancel()
                await asyncio.gather(*runs, return_exceptions=True)


async def _all(waits: list[Any]) -> None:
    await asyncio.gather(*waits)
