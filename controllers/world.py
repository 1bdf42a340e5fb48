"""Forming a world: configure the agents of a deployment's pods with one rank table and rendezvous.

The operator creates a world generation's pods; once every pod runs and has an IP, `configure_world` asks pod
0's agent where it hosts the rendezvous store, then sends the same Configure call to every agent at once. The
call is idempotent per generation, so a restarted operator repeats it safely. `world_health` reads each agent's
health for the status (pods whose ranks died are reported, and the operator re-forms the world).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

# the operator names its agents' credentials through here (it reaches agents only through the controllers)
from shardwise.agents.client import AGENT_TLS_NAME as AGENT_TLS_NAME
from shardwise.agents.client import AgentAuth as AgentAuth
from shardwise.agents.client import AgentClient, Credential, call_all, pb, world_request
from shardwise.agents.client import AgentTls as AgentTls

CALL_TIMEOUT_S = 60.0
T = TypeVar("T")


@dataclass(frozen=True)
class WorldPod:
    index: int
    address: str  # host:port of the agent's gRPC server
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class WorldLayout:
    generation: int
    model: str
    tp: int
    dpa: int
    pp: int
    seed: int = 0
    redundant_experts: int = 0
    expert_map: dict[int, list[int]] | None = None  # MoE layer -> slots; None: round robin
    map_generation: int = 0
    weights_dir: str = ""  # a checkpoint as the pods see it ("": the preset's weights from the seed)
    planned_architecture: str = ""  # JSON of the architecture planned for: the pods check the checkpoint against it
    dtype: str = "float64"  # what the ranks compute in
    moe_tp: int = 1  # ranks that split each routed expert
    cp: int = 1  # ranks that split each sequence, with their mode, layout and decode merge
    cp_mode: str = "dcp"
    cp_layout: str = "striped"
    cp_comm: str = "ag_rs"
    max_model_len: int = 0
    joins_running_world: bool = False  # a running world switches into it: new ranks wait for that switch


class WorldError(Exception):
    """The world could not be configured (an agent refused or is unreachable); the message says which."""


def _clients(pods: list[WorldPod], token: Credential, timeout: float = CALL_TIMEOUT_S) -> list[AgentClient]:
    return [AgentClient(p.address, token, timeout=timeout) for p in sorted(pods, key=lambda p: p.index)]


def _each(pods: list[WorldPod], token: Credential, ask: Callable[[AgentClient], T], unreachable: T) -> dict[int, T]:
    """Pod index -> `ask(client)` of its agent, or `unreachable` when the agent does not answer."""
    out = {}
    for p in sorted(pods, key=lambda p: p.index):
        with AgentClient(p.address, token, timeout=CALL_TIMEOUT_S) as c:
            try:
                out[p.index] = ask(c)
            except grpc.RpcError:
                out[p.index] = unreachable
    return out


def configured_generations(pods: list[WorldPod], token: Credential) -> dict[int, int]:
    """Pod index -> the generation its agent serves (0: not configured; -1: unreachable)."""
    return _each(pods, token, lambda c: int(c.describe().generation), -1)


def active_worlds(pods: list[WorldPod], token: Credential) -> dict[int, tuple[int, tuple[int, ...], int]]:
    """Pod index -> (the generation its agent serves, the ranks it runs in it, that world's size), for each agent
    that answers."""
    def ask(c: AgentClient) -> tuple[int, tuple[int, ...], int]:
        d = c.describe()
        return int(d.generation), tuple(sorted(int(r.rank) for r in d.ranks)), int(d.world_size)

    unreachable: tuple[int, tuple[int, ...], int] = (-1, (), 0)
    return {i: w for i, w in _each(pods, token, ask, unreachable).items() if w[0] >= 0}


def rendezvous_of(pod: WorldPod, token: Credential) -> str:
    """The address of the TCPStore the pod's agent hosts (every worker pod hosts one)."""
    with AgentClient(pod.address, token, timeout=CALL_TIMEOUT_S) as c:
        try:
            address = c.describe().rendezvous_address
        except grpc.RpcError as e:
            raise WorldError(f"pod {pod.index}'s agent at {pod.address} did not answer: {e.code().name}") from e
    if not address:
        raise WorldError(f"pod {pod.index}'s agent at {pod.address} hosts no rendezvous store")
    return address


def configure_world(pods: list[WorldPod], token: Credential, layout: WorldLayout) -> None:
    """Configure generation `layout.generation` on every pod given: each runs `pod.ranks` (none: it leaves at
    the switch). The world meets at the store of the lowest-index pod that stays."""
    pods = sorted(pods, key=lambda p: p.index)
    staying = [p for p in pods if p.ranks]
    if not staying:
        raise WorldError("no pod keeps a rank")
    rendezvous = rendezvous_of(staying[0], token)
    table: list[list[int]] = [[] for _ in range(pods[-1].index + 1)]
    for p in pods:
        table[p.index] = list(p.ranks)
    request = world_request(generation=layout.generation, model=layout.model, tp=layout.tp, dpa=layout.dpa,
                            pp=layout.pp, pods=table, rendezvous=rendezvous, seed=layout.seed,
                            weights=layout.weights_dir, planned_architecture=layout.planned_architecture,
                            dtype=layout.dtype, moe_tp=layout.moe_tp, cp=layout.cp, cp_mode=layout.cp_mode,
                            cp_layout=layout.cp_layout, cp_comm=layout.cp_comm, max_model_len=layout.max_model_len,
                            redundant_experts=layout.redundant_experts, expert_map=layout.expert_map,
                            map_generation=layout.map_generation,
                            joins_running_world=layout.joins_running_world)
    clients = _clients(pods, token)
    try:
        call_all(clients, "Configure", request, CALL_TIMEOUT_S)
    except grpc.RpcError as e:
        raise WorldError(f"Configure generation {layout.generation} failed: {e.code().name}: {e.details()}") from e
    finally:
        for c in clients:
            c.close()


def call_each(pods: list[WorldPod], token: Credential, method: str, timeout: float, **fields: object) -> list[Any]:
    """`method` (Pause, Switch, Resume, Prepare, Drain, Abort, ...) with the request `fields` on every pod at
    once: collective steps must never go one pod after another."""
    request = getattr(pb, f"{method}Request")(**fields)
    clients = _clients(pods, token, timeout)
    try:
        return call_all(clients, method, request, timeout)
    except grpc.RpcError as e:
        raise WorldError(f"{method} failed: {e.code().name}: {e.details()}") from e
    finally:
        for c in clients:
            c.close()


def rank_states(pods: list[WorldPod], token: Credential) -> dict[int, list[str]]:
    """Pod index -> the states of its ranks (STARTING, READY, SERVING, PAUSED, CRASHED, EXITED), or
    ["UNREACHABLE"]."""
    return _each(pods, token, lambda c: c.rank_states(), ["UNREACHABLE"])


def world_health(pods: list[WorldPod], token: Credential) -> dict[int, str]:
    """Pod index -> SERVING, STARTING, DEGRADED (a rank died), UNCONFIGURED, PAUSED or UNREACHABLE."""
    return _each(pods, token, lambda c: c.status(), "UNREACHABLE")


def engine_failure(address: str, token: Credential) -> str:
    """Why a pod's engine is down, from its agent's Health: the exit code, the restarts so far and the engine's
    last error line ("" when it answers nothing of the kind)."""
    with AgentClient(address, token, timeout=CALL_TIMEOUT_S) as c:
        try:
            ranks = list(c.health().ranks)
        except grpc.RpcError:
            return ""
    down = next((r for r in ranks if r.HasField("exit_code")), None)
    if down is None:
        return ""
    restarts = f", restarted {down.restarts} times" if down.restarts else ""
    return f"vLLM exited with code {down.exit_code}{restarts}: {down.last_error or 'no error line in its log'}"
