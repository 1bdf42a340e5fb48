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
    group: int = 0
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
        self.ready: dict[int, set[int]] = {}  # generation -> ranks ready in it
        self.join_seconds: dict[int, list[float]] = {}
        self.left: set[int] = set()
        self.migrations: dict[int, tuple[int, int, float]] = {}
        self.refusals: list[str] = []
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
            self.ready.setdefault(ev[2], set()).add(ev[1])
            self.join_seconds.setdefault(ev[2], []).append(ev[3])
        elif kind == "left":
            self.left.add(ev[1])
        elif kind == "migrated":
            self.migrations[ev[1]] = (ev[2], ev[3], ev[4])
        elif kind == "migration_refused":
            self.refusals.append(ev[3])
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
        gen, size = self.spec.generation, self.spec.world_size
        self.wait_for(lambda: len(self.ready.get(gen, ())) == size, timeout, f"every rank of generation {gen}")

    # ------------------------------------------------------------------------------------ serving
    def submit(self, prompt: str | list[int], max_tokens: int, group: int | None = None) -> str:
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        rid = uuid.uuid4().hex[:12]
        g = next(self.groups) if group is None else group
        with self.lock:
            self.pending[rid] = Pending(group=g)
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
        live = set(self.live_ranks())
        self.wait_for(lambda: live <= self.paused_ranks, timeout, "every rank to pause")

    def resume(self, timeout: float = 60) -> None:
        self.broadcast("resume")
        self.wait_for(lambda: not self.paused_ranks, timeout, "every rank to resume")

    def stats(self, timeout: float = 30) -> list[dict[str, Any]]:
        key = uuid.uuid4().hex
        self.broadcast("stats", key)
        self.wait_for(lambda: len(self.stats_replies.get(key, [])) == self.spec.world_size, timeout, "stats")
        return sorted(self.stats_replies.pop(key), key=lambda s: s["rank"])

    def live_ranks(self) -> list[int]:
        return list(range(self.spec.world_size))

    def drain(self, groups: list[int], timeout: float) -> bool:
        """Stop admitting on `groups` and wait for their in-flight requests; False on timeout (admission
        is restored then)."""
        for g in groups:
            self.commands[self.spec.leader(g)].put(("drain",))
        try:
            self.wait_for(lambda: not self._in_flight(groups), timeout, "drain")
            return True
        except WorldError:
            for g in groups:
                self.commands[self.spec.leader(g)].put(("admit",))
            return False

    def _in_flight(self, groups: list[int]) -> list[str]:
        return [rid for rid, p in self.pending.items() if not p.done.is_set() and p.group in groups]

    def migrate(self, map_generation: int, phy2log: dict[int, list[int]],
                timeout: float = 120) -> tuple[int, int, float]:
        """Move experts to a new map while serving; returns (experts moved, bytes moved, seconds)."""
        with self.lock:
            self.migrations.pop(map_generation, None)
            self.refusals.clear()
        self.broadcast("migrate", map_generation, phy2log)
        self.wait_for(lambda: map_generation in self.migrations or bool(self.refusals), timeout, "migration")
        if self.refusals:
            raise WorldError(self.refusals.pop())
        return self.migrations[map_generation]

    def change_world(self, dpa: int, timeout: float = 180, **spec_changes: Any) -> float:
        """Form a new world generation with `dpa` attention groups in the same processes (and new ones for
        new groups): pause, switch, resume. Leaving groups must be idle. Returns the pause in seconds."""
        import dataclasses

        from shardwise.grid import RankGrid

        old = self.spec
        new = dataclasses.replace(old, generation=old.generation + 1, dpa=dpa, **spec_changes)
        old_c, new_grid = old.grid.coordinates(), RankGrid(pp=new.pp, dpa=new.dpa, cp=1, tp=new.tp,
                                                           ep=new.dpa * new.tp)
        role_to_new = {(int(p), int(d), int(t)): int(new_grid.grid[p, d, 0, t])
                       for p in range(new.pp) for d in range(new.dpa) for t in range(new.tp)}
        started = time.monotonic()
        self.pause(timeout)
        survivors = {}
        for r in range(old.world_size):
            role = (int(old_c["pp"][r]), int(old_c["dpa"][r]), int(old_c["tp"][r]))
            survivors[r] = role_to_new.get(role)
            self.commands[r].put(("switch", new, survivors[r]))
        ctx = mp.get_context("spawn")
        commands: list[Any] = [None] * new.world_size
        procs: list[Any] = [None] * new.world_size
        for r_old, r_new in survivors.items():
            if r_new is not None:
                commands[r_new], procs[r_new] = self.commands[r_old], self.procs[r_old]
        leaving = [self.procs[r] for r, n in survivors.items() if n is None]
        leaving_q = [self.commands[r] for r, n in survivors.items() if n is None]
        for r in range(new.world_size):
            if procs[r] is None:
                commands[r] = ctx.Queue()
                procs[r] = ctx.Process(target=rank_main, args=(r, new, commands[r], self.events), daemon=True)
                procs[r].start()
        self.spec, self.commands, self.procs = new, commands, procs
        self.groups = itertools.cycle(range(new.dpa))
        with self.lock:
            self.paused_ranks.clear()
        self.wait_ready(timeout)
        self.resume(timeout)
        pause = time.monotonic() - started
        for q in leaving_q:
            q.put(("stop",))
        for p in leaving:
            p.join(30)
            if p.is_alive():
                p.kill()
        return pause

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
