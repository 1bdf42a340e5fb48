"""Forming a world: configure the agents of a deployment's pods with one rank table and rendezvous.

The operator creates a world generation's pods; once every pod runs and has an IP, `configure_world` asks pod
0's agent where it hosts the rendezvous store, then sends the same Configure call to every agent at once. The
call is idempotent per generation, so a restarted operator repeats it safely. `world_health` reads each agent's
health for the status (pods whose ranks died are reported, and the operator re-forms the world).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from shardwise.agents.client import AgentClient, call_all, world_request

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


class WorldError(Exception):
    """The world could not be configured (an agent refused or is unreachable); the message says which."""


def _clients(pods: list[WorldPod], token: str) -> list[AgentClient]:
    return [AgentClient(p.address, token, timeout=CALL_TIMEOUT_S) for p in sorted(pods, key=lambda p: p.index)]


def _each(pods: list[WorldPod], token: str, ask: Callable[[AgentClient], T], unreachable: T) -> dict[int, T]:
    """Pod index -> `ask(client)` of its agent, or `unreachable` when the agent does not answer."""
    out = {}
    for p in sorted(pods, key=lambda p: p.index):
        with AgentClient(p.address, token, timeout=CALL_TIMEOUT_S) as c:
            try:
                out[p.index] = ask(c)
            except grpc.RpcError:
                out[p.index] = unreachable
    return out


def configured_generations(pods: list[WorldPod], token: str) -> dict[int, int]:
    """Pod index -> the generation its agent serves (0: not configured; -1: unreachable)."""
    return _each(pods, token, lambda c: int(c.describe().generation), -1)


def configure_world(pods: list[WorldPod], token: str, layout: WorldLayout) -> None:
    pods = sorted(pods, key=lambda p: p.index)
    clients = _clients(pods, token)
    try:
        try:
            rendezvous = clients[0].describe().rendezvous_address
        except grpc.RpcError as e:
            raise WorldError(f"pod 0's agent at {pods[0].address} did not answer: {e.code().name}") from e
        if not rendezvous:
            raise WorldError(f"pod 0's agent at {pods[0].address} hosts no rendezvous store")
        request = world_request(generation=layout.generation, model=layout.model, tp=layout.tp, dpa=layout.dpa,
                                pp=layout.pp, pods=[list(p.ranks) for p in pods], rendezvous=rendezvous,
                                seed=layout.seed, redundant_experts=layout.redundant_experts)
        try:
            call_all(clients, "Configure", request, CALL_TIMEOUT_S)
        except grpc.RpcError as e:
            raise WorldError(f"Configure generation {layout.generation} failed: {e.code().name}: "
                             f"{e.details()}") from e
    finally:
        for c in clients:
            c.close()


def world_health(pods: list[WorldPod], token: str) -> dict[int, str]:
    """Pod index -> SERVING, STARTING, DEGRADED (a rank died), UNCONFIGURED, PAUSED or UNREACHABLE."""
    return _each(pods, token, lambda c: c.status(), "UNREACHABLE")
