"""`shardwise run`: a deployment's agents as local processes, without Kubernetes.

It validates the layout with the planner, hosts the rendezvous store, starts one `shardwise agent` per
simulated pod on 127.0.0.1 (ephemeral ports), prints each agent's gRPC address and serving URL, then `ready`
once every rank serves, and stops every process it started on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch.distributed as dist
from shardwise.agents.auth import TOKEN_ENV
from shardwise.agents.client import AgentClient
from shardwise.agents.proto import agent_pb2 as pb
from shardwise.agents.runtime.store import serve_store

START_TIMEOUT_S = 300


@dataclass
class AgentProcess:
    pod: int
    proc: subprocess.Popen[str]
    grpc: str = ""
    http: str = ""
    metrics: str = ""


def shardwise_command() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "shardwise")
    return [script] if os.path.exists(script) else [shutil.which("shardwise") or "shardwise"]


class LocalDeployment:
    """Agents of one deployment on this machine. `start()` returns once every rank serves."""

    def __init__(self, *, model: str, tp: int, dpa: int, pp: int, agents: int, redundant_experts: int = 0,
                 seed: int = 0, weights: str = "", max_model_len: int = 4096, token: str | None = None,
                 host: str = "127.0.0.1", log: Callable[[str], None] = print, served_model_name: str = "",
                 dtype: str = "float64", moe_tp: int = 1, cp: int = 1, cp_mode: str = "dcp",
                 cp_layout: str = "striped", cp_comm: str = "ag_rs",
                 pod_env: dict[int, dict[str, str]] | None = None, max_running: int = 64) -> None:
        world = tp * dpa * cp * pp
        if world % agents:
            raise ValueError(f"world size {world} (tp*dpa*cp*pp) is not divisible by --agents {agents}")
        self.per_pod, self.agents = world // agents, agents
        self.args = dict(model=model, tp=tp, dpa=dpa, pp=pp, redundant_experts=redundant_experts, seed=seed,
                         weights=weights, max_model_len=max_model_len, max_running=max_running,
                         served_model_name=served_model_name,
                         dtype=dtype, moe_tp=moe_tp, cp=cp, cp_mode=cp_mode, cp_layout=cp_layout, cp_comm=cp_comm)
        self.token = token or os.environ.get(TOKEN_ENV) or secrets.token_hex(16)
        self.host, self.log = host, log
        self.pod_env = pod_env or {}  # extra environment of some agents (fault injection in tests)
        self.store: dist.TCPStore | None = None
        self.procs: list[AgentProcess] = []

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        self.store = serve_store(self.host)
        deadline = time.monotonic() + timeout
        for pod in range(self.agents):
            self._launch(pod, list(range(pod * self.per_pod, (pod + 1) * self.per_pod)))
        for ap in self.procs:
            self._read_addresses(ap, deadline)
        self._wait_serving(deadline)

    @property
    def rendezvous(self) -> str:
        assert self.store is not None, "start() first"
        return f"{self.host}:{self.store.port}"

    def add_agent(self, pod: int, timeout: float = START_TIMEOUT_S) -> AgentProcess:
        """Start one more agent with no ranks: it waits for Configure (a new pod of a growing world)."""
        ap = self._launch(pod, [])
        self._read_addresses(ap, time.monotonic() + timeout)
        return ap

    def _launch(self, pod: int, ranks: list[int]) -> AgentProcess:
        a = self.args
        cmd = [*shardwise_command(), "agent", "--deployment", "local", "--pod-index", str(pod),
               "--host", self.host, "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0",
               "--max-model-len", str(a["max_model_len"]), "--max-running", str(a["max_running"])]
        if a["served_model_name"]:
            cmd += ["--served-model-name", str(a["served_model_name"])]
        if ranks:
            cmd += ["--ranks", ",".join(map(str, ranks)), "--rendezvous", self.rendezvous,
                    "--model", str(a["model"]), "--tp", str(a["tp"]), "--dpa", str(a["dpa"]), "--pp", str(a["pp"]),
                    "--redundant-experts", str(a["redundant_experts"]), "--seed", str(a["seed"]),
                    "--dtype", str(a["dtype"]), "--moe-tp", str(a["moe_tp"]), "--cp", str(a["cp"]),
                    "--cp-mode", str(a["cp_mode"]), "--cp-layout", str(a["cp_layout"]), "--cp-comm", str(a["cp_comm"])]
            if a["weights"]:
                cmd += ["--weights", str(a["weights"])]
        env = {**os.environ, TOKEN_ENV: self.token, **self.pod_env.get(pod, {})}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True,
                                start_new_session=True)
        ap = AgentProcess(pod, proc)
        self.procs.append(ap)
        return ap

    def _read_addresses(self, ap: AgentProcess, deadline: float) -> None:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(ap.proc.stdout.readline() if ap.proc.stdout else ""))
        reader.start()
        reader.join(max(0.1, deadline - time.monotonic()))
        if not line or not line[0].startswith("agent "):
            raise RuntimeError(f"agent {ap.pod} did not start (exit code {ap.proc.poll()})")
        fields = dict(kv.split("=", 1) for kv in line[0].split()[1:])
        ap.grpc, ap.http, ap.metrics = fields["grpc"], fields["http"], fields["metrics"]
        # keep draining stdout so the agent never blocks on a full pipe
        threading.Thread(target=lambda: [None for _ in ap.proc.stdout or []], daemon=True).start()

    def _wait_serving(self, deadline: float) -> None:
        pending = {ap.pod for ap in self.procs}
        last = ""
        while pending:
            for ap in self.procs:
                if ap.proc.poll() is not None:
                    raise RuntimeError(f"agent {ap.pod} exited with code {ap.proc.returncode}")
                if ap.pod in pending:
                    try:
                        with AgentClient(ap.grpc, self.token) as c:
                            h = c.health()
                    except grpc.RpcError:  # it printed its address, then exited (a checkpoint it cannot read)?
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            ap.proc.wait(timeout=2)
                        if ap.proc.poll() is not None:
                            raise RuntimeError(f"agent {ap.pod} exited with code {ap.proc.returncode}") from None
                        continue  # still starting: asked again
                    if h.status == pb.AGENT_STATUS_DEGRADED:
                        raise RuntimeError(f"agent {ap.pod}: a rank crashed: {[r.last_error for r in h.ranks]}")
                    if h.status == pb.AGENT_STATUS_SERVING:
                        pending.discard(ap.pod)
            msg = f"waiting for {len(pending)} of {len(self.procs)} agents to serve"
            if pending and msg != last:
                self.log(msg)
                last = msg
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"timed out: {msg}")
            if pending:
                time.sleep(0.2)  # polling a live process group for readiness, not test synchronisation

    def serving_urls(self) -> list[str]:
        urls = []
        for ap in self.procs:
            with AgentClient(ap.grpc, self.token) as c:
                url = c.describe().serving_url
            if url:
                urls.append(url)
        return urls

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM every agent (it stops its ranks), then SIGKILL each agent's process group, which holds its
        rank processes, so nothing is left behind even when an agent hung."""
        for ap in self.procs:
            if ap.proc.poll() is None:
                ap.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for ap in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                ap.proc.wait(max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(ap.proc.pid, signal.SIGKILL)
            ap.proc.wait(5)
        self.procs = []
        self.store = None

    def __enter__(self) -> LocalDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
