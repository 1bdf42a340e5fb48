"""A typed client of the node agent's gRPC API: what controllers, `shardwise agentctl` and tests use."""

from __future__ import annotations

from typing import Any

from google.protobuf.json_format import MessageToDict
from shardwise.agents.auth import AGENT_TLS_NAME, AgentAuth, AgentTls, agent_channel
from shardwise.agents.proto import agent_pb2 as pb
from shardwise.agents.proto import agent_pb2_grpc as pb_grpc

# pb goes with the client: controllers build their requests from it and never import the proto themselves
__all__ = ["AGENT_TLS_NAME", "AgentAuth", "AgentClient", "AgentTls", "Credential", "RouterClient", "call_all", "pb",
           "to_dict", "world_request"]

#: what a client is given to reach agents: the agent token (plaintext), or the token with TLS client files
Credential = str | AgentAuth


class AgentClient:
    """`token`: the agent token alone (plaintext gRPC, as local runs use), or an AgentAuth with the deployment's
    TLS client certificate (mutual TLS, as the operator talks to its pods)."""

    def __init__(self, address: str, token: Credential, timeout: float = 600.0) -> None:
        self.address, self.timeout = address, timeout
        auth = token if isinstance(token, AgentAuth) else AgentAuth(token)
        self.channel = agent_channel(address, auth.token, auth.tls)
        self.stub = pb_grpc.AgentStub(self.channel)

    def call(self, method: str, request: Any, timeout: float | None = None) -> Any:
        return getattr(self.stub, method)(request, timeout=timeout or self.timeout)

    def describe(self) -> pb.DescribeResponse:
        answer: pb.DescribeResponse = self.call("Describe", pb.DescribeRequest(), 30)  # the stub is untyped
        return answer

    def health(self) -> pb.HealthResponse:
        answer: pb.HealthResponse = self.call("Health", pb.HealthRequest(), 30)  # the stub is untyped
        return answer

    def status(self) -> str:
        """The agent's health as a word: SERVING, STARTING, PAUSED, DEGRADED (a rank died) or UNCONFIGURED."""
        return str(pb.AgentStatus.Name(self.health().status)).removeprefix("AGENT_STATUS_")

    def rank_states(self) -> list[str]:
        """The state of each local rank as a word: STARTING, READY (loaded, waiting), SERVING, PAUSED, ..."""
        return [str(pb.RankState.Name(r.state)).removeprefix("RANK_STATE_") for r in self.health().ranks]

    def stats(self) -> pb.StatsResponse:
        answer: pb.StatsResponse = self.call("Stats", pb.StatsRequest(), 30)  # the stub is untyped
        return answer

    def expert_load(self, timeout: float = 30) -> pb.ExpertLoad:
        """The pod's current expert-load window and expert map (the first message of StreamExpertLoad)."""
        stream = self.stub.StreamExpertLoad(pb.StreamExpertLoadRequest(interval_ms=1000), timeout=timeout)
        try:
            first: pb.ExpertLoad = next(iter(stream))
            return first
        finally:
            stream.cancel()

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


def world_request(*, generation: int, model: str, tp: int, dpa: int, pp: int, pods: list[list[int]],
                  rendezvous: str, seed: int = 0, weights: str = "", redundant_experts: int = 0,
                  map_generation: int = 0, expert_map: dict[int, list[int]] | None = None,
                  planned_architecture: str = "", dtype: str = "float64", moe_tp: int = 1, cp: int = 1,
                  cp_mode: str = "dcp", cp_layout: str = "striped", cp_comm: str = "ag_rs",
                  max_model_len: int = 0, joins_running_world: bool = False) -> pb.ConfigureRequest:
    """The Configure call that forms world `generation`: the whole rank table of the (PP, DPA, TP) grid, pod `i`
    running the ranks `pods[i]` (local GPU = position), and the expert map: `expert_map` (MoE layer -> slots)
    when given, else with redundant experts the round-robin one (else the ranks' default, also round robin)."""
    from shardwise.grid import RankGrid

    grid = RankGrid(pp=pp, dpa=dpa, cp=cp, tp=tp, ep=dpa * cp * tp // moe_tp, moe_tp=moe_tp)
    c = grid.coordinates()
    where = {r: (p, g) for p, ranks in enumerate(pods) for g, r in enumerate(ranks)}
    if sorted(where) != list(range(grid.world_size)):
        raise ValueError(f"the pods hold ranks {sorted(where)}, not 0..{grid.world_size - 1}")
    table = [pb.RankEntry(rank=r, pod=where[r][0], local_gpu=where[r][1], tp_rank=int(c["tp"][r]),
                          cp_rank=int(c["cp"][r]), dpa_group=int(c["dpa"][r]), pp_stage=int(c["pp"][r]),
                          ep_rank=int(c["ep"][r]))
             for r in range(grid.world_size)]
    layers = []
    if expert_map:
        layers = [pb.LayerMap(layer=i, phy2log=list(slots)) for i, slots in sorted(expert_map.items())]
    elif redundant_experts:
        from shardwise.agents.runtime.experts import round_robin

        from shardwise.checkpoint import model_architecture

        arch = model_architecture(model, weights or None)
        slots = round_robin(arch.num_experts, arch.num_experts + redundant_experts).tolist()
        layers = [pb.LayerMap(layer=i, phy2log=slots) for i in range(arch.num_layers) if arch.is_moe_layer(i)]
    return pb.ConfigureRequest(
        generation=generation, world_size=grid.world_size, rendezvous_address=rendezvous, ranks=table,
        sizes=pb.ParallelSizes(tp=tp, dpa=dpa, pp=pp, cp=cp, ep=grid.ep, moe_tp=moe_tp), expert_map=layers,
        map_generation=map_generation, model_preset=model, seed=seed, weights_dir=weights,
        planned_architecture=planned_architecture, dtype=dtype, cp_mode=cp_mode, cp_layout=cp_layout,
        cp_comm=cp_comm, max_model_len=max_model_len, joins_running_world=joins_running_world)


def call_all(clients: list[AgentClient], method: str, request: Any, timeout: float | None = None) -> list[Any]:
    """The same call on every agent at once: collective operations (a migration, a world switch) only
    complete when every pod's ranks take part, so they must never be issued one pod after another."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, len(clients))) as pool:
        futures = [pool.submit(c.call, method, request, timeout) for c in clients]
        return [f.result() for f in futures]


class RouterClient:
    """The router's control routes over HTTP: its route table (`GET /v1/router`, `PUT /v1/router/routes`)."""

    def __init__(self, url: str, token: str, timeout: float = 5.0) -> None:
        self.url, self.token, self.timeout = url.rstrip("/"), token, timeout

    def describe(self) -> dict[str, Any]:
        return self._call("GET", "/v1/router")

    def put_routes(self, table: dict[str, Any]) -> str:
        return str(self._call("PUT", "/v1/router/routes", table)["version"])

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        import json
        import urllib.request

        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            out = json.loads(r.read())
        return out if isinstance(out, dict) else {}
