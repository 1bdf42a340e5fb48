"""`shardwise agentctl`: one gRPC call to an agent, answered as a dict (printed as JSON by the CLI)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import grpc
from shardwise.agents.auth import TOKEN_ENV, AgentAuth, AgentTls, AgentTokenError
from shardwise.agents.client import AgentClient, to_dict
from shardwise.agents.proto import agent_pb2 as pb


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from e


def call(address: str, token: str | None, command: str, *, generation: int | None = None, deadline_ms: int = 0,
         groups: str = "", ids: str = "", map_file: Path | None = None,
         tls_dir: Path | None = None) -> dict[str, Any]:
    """Raises ValueError for bad usage or a refused call (with the gRPC status and message). With `tls_dir` (the
    deployment's ca.crt, client.crt and client.key) the call goes over mutual TLS."""
    token = token or os.environ.get(TOKEN_ENV, "")
    if not token:
        raise ValueError(f"no agent token: pass --token or set {TOKEN_ENV}")
    try:
        tls = AgentTls.client_from_dir(tls_dir) if tls_dir is not None else None
    except AgentTokenError as e:
        raise ValueError(str(e)) from e
    with AgentClient(address, AgentAuth(token, tls)) as c:
        try:
            if command == "describe":
                return to_dict(c.describe())
            if command == "health":
                return to_dict(c.health())
            if command == "stats":
                return to_dict(c.stats())
            gen = generation or c.generation()
            if command == "pause":
                return to_dict(c.call("Pause", pb.PauseRequest(generation=gen, deadline_ms=deadline_ms)))
            if command == "resume":
                return to_dict(c.call("Resume", pb.ResumeRequest(generation=gen)))
            if command == "drain":
                return to_dict(c.call("Drain", pb.DrainRequest(generation=gen, deadline_ms=deadline_ms,
                                                               dpa_groups=_ints(groups))))
            if command == "abort":
                return to_dict(c.call("Abort", pb.AbortRequest(generation=gen, dpa_groups=_ints(groups),
                                                               request_ids=[i for i in ids.split(",") if i])))
            if command == "load":
                stream = c.stub.StreamExpertLoad(pb.StreamExpertLoadRequest(interval_ms=100), timeout=30)
                first = next(iter(stream))
                stream.cancel()
                return to_dict(first)
            if command == "migrate":
                if map_file is None:
                    raise ValueError("migrate needs --map FILE.json")
                data = json.loads(map_file.read_text())
                layers = [pb.LayerMap(layer=int(k), phy2log=v) for k, v in data["layers"].items()]
                return to_dict(c.call("UpdateExpertMap", pb.UpdateExpertMapRequest(
                    generation=gen, map_generation=int(data["mapGeneration"]), layers=layers)))
        except grpc.RpcError as e:
            raise ValueError(f"{e.code().name}: {e.details()}") from e
    raise ValueError(f"unknown command {command!r}")
