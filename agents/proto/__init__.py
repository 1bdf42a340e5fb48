"""The node agent's gRPC contract, `shardwise.agent.v1.Agent`, and its generated stubs.

The one source is `shardwise/agent/v1/agent.proto` below this folder; `make proto` writes `agent_pb2.py`,
`agent_pb2.pyi` and `agent_pb2_grpc.py` next to it (never edit them; a test fails when they are stale).
The proto keeps its canonical path so its registered name is `shardwise/agent/v1/agent.proto`; import the
stubs from here:

    from shardwise.agents.proto import agent_pb2, agent_pb2_grpc
"""

from .shardwise.agent.v1 import agent_pb2, agent_pb2_grpc

__all__ = ["agent_pb2", "agent_pb2_grpc"]
