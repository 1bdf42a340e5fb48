"""A typed client of the node agent's gRPC API: what controllers, `shardwise agentctl` and tests use."""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from shardwise.agents.auth import with_token
from shardwise.agents.proto import agent_pb2 as pb
from shardwise.agents.proto import agent_pb2_grpc as pb_grpc


class AgentClient:
    def __init__(self, address: str, token: str, timeout: float = 600.0) -> None:
        self.address, self.timeout = address, timeout
        self.channel = with_token(grpc.insecure_channel(address), token)
        self.stub = pb_grpc.AgentStub(self.channel)

    def call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        return getattr(self.stub, method)(request, timeout=timeout or self.timeout)

    def describe(self) -> pb.DescribeResponse:
        return self.call("Describe", pb.DescribeRequest(), 30)

    def health(self) -> pb.HealthResponse:
        return self.call("Health", pb.HealthRequest(), 30)

    def stats(self) -> pb.StatsResponse:
        return self.call("Stats", pb.StatsRequest(), 30)

    def generation(self) -> int:
        return int(self.describe().generation)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def to_dict(message: Any) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def call_all(clients: list[AgentClient], method: str, request: Any, timeout: float | None = None) -> list[Any]:
    """The same call on every agent at once: collective operations (a migration, a world switch) only
    complete when every pod's ranks take part, so they must never be issued one pod after another."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, len(clients))) as pool:
        futures = [pool.submit(c.call, method, request, timeout) for c in clients]
        return [f.result() for f in futures]
