"""`shardwise agent`: start the servers of a node agent, configure its ranks, poll them, stop on SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from shardwise.agents import http, metrics
from shardwise.agents.agent import Agent, AgentConfig, CallError, Servicer
from shardwise.agents.auth import TokenAuthInterceptor, load_api_key, load_tls, load_token, serve_port
from shardwise.agents.client import world_request
from shardwise.agents.proto import agent_pb2 as pb
from shardwise.agents.proto import agent_pb2_grpc as pb_grpc
from shardwise.agents.runtime.warm import wait_warm, warm_rank_starts

POLL_S = 1.0
log = logging.getLogger("shardwise.agent")


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
    max_running: int = 64
    served_model_name: str = ""
    dtype: str = "float64"
    moe_tp: int = 1
    cp: int = 1
    cp_mode: str = "dcp"
    cp_layout: str = "striped"
    cp_comm: str = "ag_rs"
    wait_for_configure: bool = False
    host_store: bool = False
    store_port: int = 29500
    expert_metrics: str = "aggregate"  # or "per-expert": one series per logical expert and layer


def configure_request(o: AgentOptions) -> pb.ConfigureRequest:
    """The Configure call an agent makes to itself when its world is given on the command line (or env): pods
    of len(ranks) consecutive ranks."""
    world, per_pod = o.tp * o.dpa * o.cp * o.pp, len(o.ranks)
    pods = [list(range(p, p + per_pod)) for p in range(0, world, per_pod)]
    return world_request(generation=o.generation, model=o.model, tp=o.tp, dpa=o.dpa, pp=o.pp, pods=pods,
                         rendezvous=o.rendezvous, seed=o.seed, weights=o.weights,
                         redundant_experts=o.redundant_experts, dtype=o.dtype, moe_tp=o.moe_tp, cp=o.cp,
                         cp_mode=o.cp_mode, cp_layout=o.cp_layout, cp_comm=o.cp_comm, max_model_len=o.max_model_len)


def host_store(host: str, port: int) -> Any:
    """The deployment's rendezvous store, hosted by pod 0's agent for as long as it lives, on the pod's own
    address only. Where the port is taken (two deployments' pods sharing one host's network) it takes a free one;
    the agent reports the address it got in Describe."""
    from shardwise.agents.runtime.store import serve_store

    try:
        return serve_store(host, port)
    except (RuntimeError, OSError):
        if not port:
            raise
        log.warning("rendezvous port %d is taken; hosting the store on a free port", port)
        return serve_store(host, 0)


def run_vllm(o: AgentOptions, args: tuple[str, ...]) -> int:
    """`engine: vllm`: the same gRPC API over a supervised vLLM server (see `shardwise.agents.vllm_engine`)."""
    from shardwise.agents import vllm_engine as engine

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = load_token()
    agent = engine.VllmAgent(engine.VllmConfig(deployment=o.deployment, pod_index=o.pod_index, host=o.host,
                                               python=engine.vllm_python(), args=args,
                                               drain_timeout_s=engine.drain_timeout(args)))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), interceptors=[TokenAuthInterceptor(token)])
    pb_grpc.add_AgentServicer_to_server(Servicer(agent), server)
    grpc_port = serve_port(server, f"{o.host}:{o.grpc_port}", load_tls())
    server.start()
    web = engine.serve_http(agent, o.host, o.http_port)
    agent.serving_url = f"http://{o.host}:{web.server_address[1]}"
    metrics_server, metrics_port = engine.serve_metrics(agent, o.host, o.metrics_port)
    print(f"agent pod={o.pod_index} engine=vllm grpc={o.host}:{grpc_port} http={agent.serving_url} "
          f"metrics=http://{o.host}:{metrics_port}/metrics vllm={agent.supervisor.python}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
        agent.shutdown()  # stop admitting, let requests in flight finish, stop vLLM
    finally:
        server.stop(grace=2).wait(5)
        web.shutdown()
        metrics_server.shutdown()
        agent.close()
    return 0


def run(o: AgentOptions) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = load_token()
    # torch imported once, in a forkserver, while the pod waits for its Configure: its ranks start in 0.1 s
    rank_start = warm_rank_starts()
    agent = Agent(AgentConfig(deployment=o.deployment, pod_index=o.pod_index, host=o.host,
                              max_model_len=o.max_model_len, max_running=o.max_running,
                              served_model_name=o.served_model_name, rank_start=rank_start))
    if rank_start == "forkserver":  # Health says `warm` once a rank would start warm (a standby pod is ready then)
        def probe() -> None:
            wait_warm()
            agent.warm.set()

        threading.Thread(target=probe, daemon=True, name="warm-probe").start()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), interceptors=[TokenAuthInterceptor(token)])
    pb_grpc.add_AgentServicer_to_server(Servicer(agent), server)
    grpc_port = serve_port(server, f"{o.host}:{o.grpc_port}", load_tls())
    server.start()
    web = http.serve(agent, o.host, o.http_port, token=token, api_key=load_api_key())
    agent.config.http_port = web.server_address[1]
    agent.config.serving_url = f"http://{o.host}:{agent.config.http_port}"
    store = host_store(o.host, o.store_port) if o.host_store else None
    if store is not None:
        agent.config.rendezvous_address = f"{o.host}:{store.port}"
    metrics_server, metrics_port = metrics.serve(agent, o.host, o.metrics_port, o.expert_metrics)
    print(f"agent pod={o.pod_index} grpc={o.host}:{grpc_port} http={agent.config.serving_url} "
          f"metrics=http://{o.host}:{metrics_port}/metrics"
          + (f" rendezvous={agent.config.rendezvous_address}" if store is not None else ""), flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    code = 0
    try:
        if o.ranks and not o.wait_for_configure:
            agent.configure(configure_request(o))
        while not stop.wait(POLL_S):
            agent.refresh()
    except CallError as e:
        print(f"error: {e.message}", file=sys.stderr, flush=True)
        code = 2
    finally:
        # the ranks first: their world breaks at once, so that the other pods' survivors re-form it without
        # waiting for these servers to wind down (a deleted pod serves again sooner); then the servers
        agent.close()
        server.stop(grace=2).wait(5)
        web.shutdown()
        metrics_server.shutdown()  # type: ignore[attr-defined]
        del store
    return code
