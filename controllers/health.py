"""The agents' health as they push it: one `WatchHealth` stream per pod of a serving world.

Kubernetes learns of a crashed rank from the pod's readiness probe (a second or two); the operator would learn of
it at its next step. A `HealthWatch` holds a stream to every agent of the world instead: the agent sends its
health whenever its status or a rank's state changes (checked every 50 ms), and the watch calls `on_change`
(which wakes the deployment's step) the moment a pod's status, generation or rank states differ from the last
ones seen (a recovery waits for its survivors' ranks to stand by: each one that does wakes it). A stream that
breaks, or stays silent for two heartbeats, counts as UNREACHABLE until it is back (it is reopened every
`RETRY_S`); `silent()` names the agents not heard from for three heartbeats (hung, stopped or cut off).

    watch = HealthWatch({0: "10.0.0.4:50051", 1: "10.0.0.5:50051"}, auth, on_change=wake)
    watch.statuses()  # {0: "SERVING", 1: "DEGRADED"}
    watch.silent()    # {1: 16.2}: pod 1's agent has sent nothing for 16.2 s
    watch.close()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc
from shardwise.agents.client import AgentClient, Credential, pb

log = logging.getLogger("shardwise.operator")

RETRY_S = 0.5  # between two attempts to reopen a broken stream
HEARTBEAT_MS = 5000  # the agent sends its health at least this often, so a silent stream is a dead one


class HealthWatch:
    """Streams of the agents' health; `statuses()` is the last status each pod pushed ("STARTING" before its
    first message, "UNREACHABLE" while its stream is down)."""

    def __init__(self, addresses: Mapping[int, str], token: Credential, on_change: Callable[[], None], *,
                 heartbeat_ms: int = HEARTBEAT_MS) -> None:
        self.addresses = dict(addresses)
        self.heartbeat_ms = heartbeat_ms
        self._token, self._on_change = token, on_change
        self._lock = threading.Lock()
        self._status = {i: "STARTING" for i in self.addresses}
        self._heard = {i: time.monotonic() for i in self.addresses}  # the last message of each (or the start)
        self._generation: dict[int, int] = {}  # the world generation each pod last said it serves
        self._ranks: dict[int, tuple[tuple[int, str], ...]] = {}  # each pod's ranks and their states, last pushed
        self._closed = threading.Event()
        self._calls: dict[int, Any] = {}  # the open streams (grpc's call objects), to cancel
        self._threads = [threading.Thread(target=self._follow, args=(i, a), daemon=True, name=f"health-{i}")
                         for i, a in self.addresses.items()]
        for t in self._threads:
            t.start()

    def statuses(self) -> dict[int, str]:
        with self._lock:
            return dict(self._status)

    def silent(self, seconds: float | None = None) -> dict[int, float]:
        """Pods whose agent has sent nothing for more than `seconds` (default: three heartbeats; a healthy one
        sends one every `heartbeat_ms`): how long, counted from the watch's start for one never heard from."""
        seconds = 3 * self.heartbeat_ms / 1000 if seconds is None else seconds
        now = time.monotonic()
        with self._lock:
            return {i: now - t for i, t in self._heard.items() if now - t > seconds}

    def generations(self) -> dict[int, int]:
        """The world generation each pod last said it serves (pods not heard from yet are absent)."""
        with self._lock:
            return dict(self._generation)

    def rank_states(self) -> dict[int, tuple[tuple[int, str], ...]]:
        """Each pod's ranks (global rank, state) as it last pushed them (pods not heard from yet are absent)."""
        with self._lock:
            return dict(self._ranks)

    def degraded(self) -> list[int]:
        """Pods whose agent last said DEGRADED (a rank crashed or stands by after a restart)."""
        return sorted(i for i, s in self.statuses().items() if s == "DEGRADED")

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            calls = list(self._calls.values())
        for call in calls:
            call.cancel()
        for t in self._threads:
            t.join(timeout=5)

    def _set(self, index: int, status: str, *, heard: bool = False, generation: int | None = None,
             ranks: tuple[tuple[int, str], ...] | None = None) -> None:
        with self._lock:
            if heard:
                self._heard[index] = time.monotonic()
            changed = self._status.get(index) != status
            self._status[index] = status
            if generation is not None:
                changed = changed or self._generation.get(index) != generation
                self._generation[index] = generation
            if ranks is not None:
                changed = changed or self._ranks.get(index) != ranks
                self._ranks[index] = ranks
        if changed and not self._closed.is_set():
            try:
                self._on_change()
            except Exception:  # a wake-up that fails must not end the watch
                log.exception("health watch: waking the step failed")

    def _follow(self, index: int, address: str) -> None:
        request = pb.WatchHealthRequest(interval_ms=50, heartbeat_ms=self.heartbeat_ms)
        quiet = 2 * self.heartbeat_ms / 1000  # no message for this long: the stream is given up and reopened
        while not self._closed.is_set():
            with AgentClient(address, self._token) as client:
                stream = client.stub.WatchHealth(request, timeout=None)
                with self._lock:
                    self._calls[index] = stream
                if self._closed.is_set():
                    stream.cancel()
                timer = threading.Timer(quiet, stream.cancel)
                timer.start()
                try:
                    for health in stream:
                        timer.cancel()
                        self._set(index, pb.AgentStatus.Name(health.status).removeprefix("AGENT_STATUS_"), heard=True,
                                  generation=int(health.generation),
                                  ranks=tuple((int(r.rank), pb.RankState.Name(r.state).removeprefix("RANK_STATE_"))
                                              for r in health.ranks))
                        timer = threading.Timer(quiet, stream.cancel)
                        timer.start()
                except grpc.RpcError:
                    pass
                finally:
                    timer.cancel()
                    with self._lock:
                        self._calls.pop(index, None)
            if not self._closed.is_set():
                self._set(index, "UNREACHABLE")
                self._closed.wait(RETRY_S)
