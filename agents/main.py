"""`shardwise agent`: start the servers of a node agent, configure its ranks, poll them, stop on SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from shardwise.agents import http, metrics
from shardwise.agents.agent import Agent, AgentConfig, CallError, Servicer
from shardwise.agents.auth import TokenAuthInterceptor, load_token
from shardwise.agents.proto import agent_pb2 as pb
from shardwise.agents.proto import agent_pb2_grpc as pb_grpc

from shardwise.grid import RankGrid

POLL_S = 1.0


@dataclass(frozen=True)
class AgentOptions:
    deployment: str
    pod_index: int
    host: str
    grpc_port: int
    http_port: int
    metrics_port: int
    generation: int = 1
    ranks: tuple[int, ...] = ()
    rendezvous: str = ""
    model: str = "tiny-moe"
    tp: int = 1
    dpa: int = 1
    pp: int = 1
    redundant_experts: int = 0
    seed: int = 0
    weights: str = ""
    max_model_len: int = 4096


def configure_request(o: AgentOptions) -> pb.ConfigureRequest:
    """The Configure call an agent makes to itself when its world is given on the command line (or env):
    the whole rank table of the grid, pods of len(ranks) consecutive ranks."""
    grid = RankGrid(pp=o.pp, dpa=o.dpa, cp=1, tp=o.tp, ep=o.dpa * o.tp)
    c, per_pod = grid.coordinates(), len(o.ranks)
    table = [pb.RankEntry(rank=r, pod=r // per_pod, local_gpu=r % per_pod, tp_rank=int(c["tp"][r]), cp_rank=0,
                          dpa_group=int(c["dpa"][r]), pp_stage=int(c["pp"][r]), ep_rank=int(c["ep"][r]))
             for r in range(grid.world_size)]
    expert_map = []
    if o.redundant_experts:
        from shardwise.agents.runtime.experts import round_robin

        from shardwise.presets import model_preset

        arch = model_preset(o.model)
        slots = round_robin(arch.num_experts, arch.num_experts + o.redundant_experts).tolist()
        expert_map = [pb.LayerMap(layer=i, phy2log=slots) for i in range(arch.num_layers) if arch.is_moe_layer(i)]
    return pb.ConfigureRequest(
        generation=o.generation, world_size=grid.world_size, rendezvous_address=o.rendezvous, ranks=table,
        sizes=pb.ParallelSizes(tp=o.tp, dpa=o.dpa, pp=o.pp, cp=1, ep=o.dpa * o.tp, moe_tp=1),
        expert_map=expert_map, map_generation=0, model_preset=o.model, seed=o.seed, weights_dir=o.weights)


def run(o: AgentOptions) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = load_token()
    agent = Agent(AgentConfig(deployment=o.deployment, pod_index=o.pod_index, host=o.host,
                              max_model_len=o.max_model_len))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), interceptors=[TokenAuthInterceptor(token)])
    pb_grpc.add_AgentServicer_to_server(Servicer(agent), server)
    grpc_port = server.add_insecure_port(f"{o.host}:{o.grpc_port}")
    server.start()
    web = http.serve(agent, o.host, o.http_port)
    agent.config.http_port = web.server_address[1]
    agent.config.serving_url = f"http://{o.host}:{agent.config.http_port}"
    metrics_server, metrics_port = metrics.serve(agent, o.host, o.metrics_port)
    print(f"agent pod={o.pod_index} grpc={o.host}:{grpc_port} http={agent.config.serving_url} "
          f"metrics=http://{o.host}:{metrics_port}/metrics", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    code = 0
    try:
        if o.ranks:
            agent.configure(configure_request(o))
        while not stop.wait(POLL_S):
            agent.refresh()
    except CallError as e:
        print(f"error: {e.message}", file=sys.stderr, flush=True)
        code = 2
    finally:
        server.stop(grace=2).wait(5)
        web.shutdown()
        metrics_server.shutdown()  # type: ignore[attr-defined]
        agent.close()
    return code
