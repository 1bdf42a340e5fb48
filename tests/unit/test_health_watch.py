"""The operator's watch of its agents' pushed health, on real gRPC servers: a pod that reports a crash wakes the
deployment's step within a fraction of a second (no polling), a pod whose server goes away reads UNREACHABLE,
one that comes back is followed again, one that stops sending (hung) is named silent while its heartbeating
neighbour is not, and a rank's state change alone (standing by after its world broke) wakes the step too."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest
from shardwise.agents.auth import TokenAuthInterceptor, serve_port
from shardwise.agents.proto import agent_pb2 as pb
from shardwise.agents.proto import agent_pb2_grpc as pb_grpc
from shardwise.controllers.health import HealthWatch

TOKEN = "watch-token"


class Pod(pb_grpc.AgentServicer):
    """An agent's WatchHealth as the real one sends it: the status at once, then on every change."""

    def __init__(self) -> None:
        self.status = pb.AGENT_STATUS_SERVING
        self.generation = 1
        self.ranks = (pb.RANK_STATE_SERVING, pb.RANK_STATE_SERVING)  # ranks 0 and 1's states
        self.changed = threading.Condition()
        self.hung = threading.Event()  # set: sends nothing more, as a stopped process (the connection stays up)

    def set(self, status: int, generation: int | None = None, ranks: tuple[int, int] | None = None) -> None:
        with self.changed:
            self.status = status
            self.generation = self.generation if generation is None else generation
            self.ranks = self.ranks if ranks is None else ranks
            self.changed.notify_all()

    def WatchHealth(self, request: pb.WatchHealthRequest, context: grpc.ServicerContext
                    ) -> Iterator[pb.HealthResponse]:
        sent, at = None, 0.0
        while context.is_active():
            if self.hung.is_set():
                time.sleep(0.05)
                continue
            with self.changed:
                if (self.status, self.generation, self.ranks) == sent:
                    self.changed.wait(0.05)
                now = (self.status, self.generation, self.ranks)
            if now != sent or (request.heartbeat_ms and time.monotonic() - at >= request.heartbeat_ms / 1000):
                sent, at = now, time.monotonic()
                yield pb.HealthResponse(status=now[0], generation=now[1],
                                        ranks=[pb.RankHealth(rank=r, state=s) for r, s in enumerate(now[2])])


def serve(pod: Pod, port: int = 0) -> tuple[grpc.Server, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[TokenAuthInterceptor(TOKEN)])
    pb_grpc.add_AgentServicer_to_server(pod, server)
    bound = serve_port(server, f"127.0.0.1:{port}", None)
    server.start()
    return server, bound


def until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.01)


@pytest.fixture
def pods() -> Iterator[list[tuple[Pod, grpc.Server, int]]]:
    out = []
    for _ in range(2):
        pod = Pod()
        server, port = serve(pod)
        out.append((pod, server, port))
    yield out
    for _, server, _ in out:
        server.stop(grace=None)


def test_a_crash_one_pod_pushes_wakes_the_step_at_once_and_reads_degraded(
        pods: list[tuple[Pod, grpc.Server, int]]) -> None:
    woken = threading.Event()
    watch = HealthWatch({i: f"127.0.0.1:{port}" for i, (_, _, port) in enumerate(pods)}, TOKEN, woken.set)
    try:
        until(lambda: watch.statuses() == {0: "SERVING", 1: "SERVING"}, 10, "both pods seen serving")
        woken.clear()
        pods[1][0].set(pb.AGENT_STATUS_DEGRADED)
        assert woken.wait(2), "the step was not woken by the pushed crash"
        until(lambda: watch.degraded() == [1], 2, "pod 1 degraded")
    finally:
        watch.close()


def test_a_pod_that_goes_away_reads_unreachable_and_is_followed_again_when_it_is_back(
        pods: list[tuple[Pod, grpc.Server, int]]) -> None:
    pod, server, port = pods[0]
    watch = HealthWatch({0: f"127.0.0.1:{port}"}, TOKEN, lambda: None)
    try:
        until(lambda: watch.statuses() == {0: "SERVING"}, 10, "the pod seen serving")
        server.stop(grace=None)
        until(lambda: watch.statuses() == {0: "UNREACHABLE"}, 10, "the stopped pod unreachable")
        pod.set(pb.AGENT_STATUS_STARTING)
        again, _ = serve(pod, port)
        try:
            until(lambda: watch.statuses() == {0: "STARTING"}, 10, "the pod followed again")
        finally:
            again.stop(grace=None)
    finally:
        watch.close()


def test_a_closed_watch_wakes_nothing_and_stops_its_streams(pods: list[tuple[Pod, grpc.Server, int]]) -> None:
    calls = []
    watch = HealthWatch({0: f"127.0.0.1:{pods[0][2]}"}, TOKEN, lambda: calls.append(1))
    until(lambda: watch.statuses() == {0: "SERVING"}, 10, "the pod seen serving")
    watch.close()
    seen = len(calls)
    pods[0][0].set(pb.AGENT_STATUS_DEGRADED)
    assert all(not t.is_alive() for t in watch._threads)
    assert len(calls) == seen


def test_an_agent_that_stops_sending_is_named_silent_and_one_that_heartbeats_is_not(
        pods: list[tuple[Pod, grpc.Server, int]]) -> None:
    watch = HealthWatch({i: f"127.0.0.1:{port}" for i, (_, _, port) in enumerate(pods)}, TOKEN, lambda: None,
                        heartbeat_ms=100)
    try:
        until(lambda: watch.statuses() == {0: "SERVING", 1: "SERVING"}, 10, "both pods seen serving")
        assert watch.silent() == {}
        pods[1][0].hung.set()
        until(lambda: set(watch.silent()) == {1}, 10, "pod 1 named silent")
        until(lambda: watch.statuses()[1] == "UNREACHABLE", 10, "pod 1's silent stream given up")
        pods[1][0].hung.clear()
        until(lambda: watch.silent() == {} and watch.statuses()[1] == "SERVING", 10, "pod 1 heard from again")
        assert watch.statuses()[0] == "SERVING"
    finally:
        watch.close()


def test_a_pod_that_serves_a_later_world_wakes_the_step_and_reads_its_generation(
        pods: list[tuple[Pod, grpc.Server, int]]) -> None:
    # what an operator restarted after an unrecorded recovery finds: an agent serving a world the status lacks
    woken = threading.Event()
    watch = HealthWatch({i: f"127.0.0.1:{port}" for i, (_, _, port) in enumerate(pods)}, TOKEN, woken.set)
    try:
        until(lambda: watch.generations() == {0: 1, 1: 1}, 10, "both pods seen in world 1")
        woken.clear()
        pods[0][0].set(pb.AGENT_STATUS_SERVING, generation=2)
        assert woken.wait(2), "the step was not woken by the pushed generation"
        until(lambda: watch.generations() == {0: 2, 1: 1}, 2, "pod 0 in world 2")
    finally:
        watch.close()


def test_a_rank_that_stands_by_wakes_the_step_though_its_pod_status_stays(
        pods: list[tuple[Pod, grpc.Server, int]]) -> None:
    # a recovery waits for its survivors' ranks to leave the broken world: each one that does is pushed at once
    woken = threading.Event()
    watch = HealthWatch({0: f"127.0.0.1:{pods[0][2]}"}, TOKEN, woken.set)
    try:
        until(lambda: watch.rank_states() == {0: ((0, "SERVING"), (1, "SERVING"))}, 10, "both ranks seen serving")
        woken.clear()
        pods[0][0].set(pb.AGENT_STATUS_SERVING, ranks=(pb.RANK_STATE_READY, pb.RANK_STATE_SERVING))
        assert woken.wait(2), "the step was not woken by a rank standing by"
        until(lambda: watch.rank_states() == {0: ((0, "READY"), (1, "SERVING"))}, 2, "rank 0 standing by")
        assert watch.statuses() == {0: "SERVING"}
    finally:
        watch.close()
