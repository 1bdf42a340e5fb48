"""A whole world of ranks as local processes, driven directly: the harness under the node agent and the
runtime tests. It owns the rendezvous store, one command queue per rank and one event queue, and stops
every process it started."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from shardwise.agents.runtime import tokenizer
from shardwise.agents.runtime.engine import WorldSpec, rank_main


class WorldError(RuntimeError):
    """A rank crashed, refused a request, or the world did not answer in time."""


@dataclass
class Pending:
    tokens: list[int] = field(default_factory=list)
    reason: str | None = None
    refused: str | None = None
    done: threading.Event = field(default_factory=threading.Event)


class LocalWorld:
    def __init__(self, spec_args: dict[str, Any], *, start: bool = True) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.spec = WorldSpec(store_host="127.0.0.1", store_port=self.store.port, **spec_args)
        ctx = mp.get_context("spawn")
        self.events: Any = ctx.Queue()
        self.commands: list[Any] = [ctx.Queue() for _ in range(self.spec.world_size)]
        self.procs = [ctx.Process(target=rank_main, args=(r, self.spec, self.commands[r], self.events), daemon=True)
                      for r in range(self.spec.world_size)]
        self.pending: dict[str, Pending] = {}
        self.ready: set[int] = set()
        self.paused_ranks: set[int] = set()
        self.crashes: list[tuple[int, str]] = []
        self.stats_replies: dict[str, list[dict[str, Any]]] = {}
        self.lock = threading.Condition()
        self.groups = itertools.cycle(range(self.spec.dpa))
        self.pump = threading.Thread(target=self._pump, daemon=True)
        self.closed = False
        if start:
            self.start()

    def start(self) -> None:
        for p in self.procs:
            p.start()
        self.pump.start()

    # ------------------------------------------------------------------------------------- events
    def _pump(self) -> None:
        while not self.closed:
            try:
                ev = self.events.get(timeout=0.2)
            except (queue.Empty, OSError, EOFError):
                continue
            with self.lock:
                self._apply(ev)
                self.lock.notify_all()

    def _apply(self, ev: tuple[Any, ...]) -> None:
        kind = ev[0]
        if kind == "ready":
            self.ready.add(ev[1])
        elif kind == "token":
            self.pending[ev[1]].tokens.append(ev[2])
        elif kind == "done":
            self.pending[ev[1]].reason = ev[2]
            self.pending[ev[1]].done.set()
        elif kind == "refused":
            self.pending[ev[1]].refused = ev[2]
            self.pending[ev[1]].done.set()
        elif kind == "paused":
            self.paused_ranks.add(ev[1])
        elif kind == "resumed":
            self.paused_ranks.discard(ev[1])
        elif kind == "crashed":
            self.crashes.append((ev[1], ev[2]))
        elif kind == "stats":
            self.stats_replies.setdefault(ev[1], []).append(ev[2])

    def wait_for(self, predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self.lock:
            while not predicate():
                if self.crashes:
                    raise WorldError(f"rank {self.crashes[0][0]} crashed: {self.crashes[0][1]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorldError(f"timed out after {timeout:.0f} s waiting for {what}")
                self.lock.wait(min(left, 0.5))

    def wait_ready(self, timeout: float = 180) -> None:
        self.wait_for(lambda: len(self.ready) == self.spec.world_size, timeout, "every rank to be ready")

    # ------------------------------------------------------------------------------------ serving
    def submit(self, prompt: str | list[int], max_tokens: int, group: int | None = None) -> str:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        rid = uuid.uuid4().hex[:12]
        g = next(self.groups) if group is None else group
        with self.lock:
            self.pending[rid] = Pending()
        self.commands[self.spec.leader(g)].put(("submit", rid, ids, max_tokens))
        return rid

    def result(self, rid: str, timeout: float = 120) -> dict[str, Any]:
        p = self.pending[rid]
        self.wait_for(p.done.is_set, timeout, f"request {rid}")
        if p.refused:
            raise WorldError(f"request {rid} refused: {p.refused}")
        return {"id": rid, "token_ids": list(p.tokens), "text": tokenizer.decode(p.tokens), "finish_reason": p.reason}

    def complete(self, prompt: str | list[int], max_tokens: int, group: int | None = None) -> dict[str, Any]:
        return self.result(self.submit(prompt, max_tokens, group))

    def abort(self, rid: str, group: int) -> None:
        self.commands[self.spec.leader(group)].put(("abort", rid))

    # ------------------------------------------------------------------------------------ control
    def broadcast(self, *cmd: Any) -> None:
        for q in self.commands:
            q.put(cmd)

    def pause(self, timeout: float = 60) -> None:
        self.broadcast("pause")
        self.wait_for(lambda: len(self.paused_ranks) == self.spec.world_size, timeout, "every rank to pause")

    def resume(self, timeout: float = 60) -> None:
        self.broadcast("resume")
        self.wait_for(lambda: not self.paused_ranks, timeout, "every rank to resume")

    def stats(self, timeout: float = 30) -> list[dict[str, Any]]:
        key = uuid.uuid4().hex
        self.broadcast("stats", key)
        self.wait_for(lambda: len(self.stats_replies.get(key, [])) == self.spec.world_size, timeout, "stats")
        return sorted(self.stats_replies.pop(key), key=lambda s: s["rank"])

    def close(self, timeout: float = 30) -> None:
        """Stop every rank: ask, then terminate and kill by PID what did not exit."""
        self.broadcast("stop")
        deadline = time.monotonic() + timeout
        for p in self.procs:
            if p.pid is not None:
                p.join(max(0.1, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.closed = True
        if self.pump.is_alive():
            self.pump.join(2)

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
