"""The rank processes of one pod (or of a whole world on one machine), driven through their queues.

`RankPool` owns the processes of the global ranks it hosts, each with its own command and event queue (a
process killed mid-write can corrupt a queue; it then silences only itself); a pump thread per process turns
its events into state that callers wait on with deadlines. The node agent holds one
pool per pod; `LocalWorld` is a pool that hosts every rank and the rendezvous store (the runtime tests and
`shardwise run` use it). Every process a pool starts, it stops: ask, then terminate, then kill by PID.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import queue
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from shardwise.agents.runtime import tokenizer
from shardwise.agents.runtime.batching import GREEDY, Sampling
from shardwise.agents.runtime.engine import WorldSpec, rank_main
from shardwise.agents.runtime.latency import GroupLatency
from shardwise.agents.runtime.store import serve_store


class WorldError(RuntimeError):
    """A rank crashed, refused a request, or the world did not answer in time."""


class Refused(WorldError):
    """The group would not take a request (queue full, draining, prompt too long)."""


class DuplicateRequest(Refused):
    """A request id that is still in flight (an id is free again once its request has ended)."""


@dataclass
class Pending:
    group: int = 0
    tokens: list[int] = field(default_factory=list)
    reason: str | None = None
    refused: str | None = None
    error: str | None = None  # lost with a crashed world
    done: threading.Event = field(default_factory=threading.Event)
    listeners: list[Callable[[str, Any], None]] = field(default_factory=list)
    ended_at: float | None = None  # monotonic time it ended; ended requests are forgotten after KEEP_ENDED_S
    queued_at: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None  # for the time per output token

    def end(self) -> None:
        self.ended_at = time.monotonic()
        self.done.set()


RESTART_BACKOFF_S = (0.25, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0)
KEEP_ENDED_S = 60.0  # how long an ended request stays readable (`result`) before the pool forgets it


@dataclass
class RankState:
    pid: int | None = None
    state: str = "starting"  # starting | ready | serving | paused | crashed | exited | left
    error: str = ""
    join_seconds: float = 0.0
    restarts: int = 0
    restart_at: float | None = None  # when a crashed rank is due to come back (as a standby)
    exit_code: int | None = None


class RankPool:
    def __init__(self, spec: WorldSpec, local: list[int], start_method: str = "spawn", *,
                 joins_running_world: bool = False) -> None:
        """`start_method`: "spawn" (each rank a fresh interpreter), or "forkserver" after `warm_rank_starts`.
        `joins_running_world`: `spec` is a world that a running one switches into (this pod is new in a
        scale-up): the ranks wait at its rendezvous for as long as that switch takes to come."""
        self.spec = spec
        self.joins_running_world = joins_running_world
        self.local = sorted(local)
        self.ctx: Any = mp.get_context(start_method)  # SpawnContext or ForkServerContext
        self.commands: dict[int, Any] = {}
        self.procs: dict[int, Any] = {}
        self.ranks: dict[int, RankState] = {}
        self.pending: dict[str, Pending] = {}  # in flight, and ended within KEEP_ENDED_S
        self._forgot_at = 0.0
        self.ready: dict[int, set[int]] = {}  # generation -> local ranks ready in it
        self.left: set[int] = set()
        self.loaded: set[int] = set()  # ranks (by the rank they start as) whose weights are loaded
        self.migrations: dict[int, tuple[int, int, float]] = {}
        self.refusals: list[str] = []
        self.paused_ranks: set[int] = set()
        self.crashes: list[tuple[int, str]] = []
        self.stats_replies: dict[str, list[dict[str, Any]]] = {}
        self.last_pause_seconds = 0.0
        self.finished: dict[str, int] = {}
        self.latency: dict[int, GroupLatency] = {}  # per DPA group this pool leads
        self.closing = False
        self.retired: list[tuple[Any, Any, int]] = []  # (queue, process, old rank) of ranks leaving the world
        # new rank -> (queue, process, generation), started by prepare() for that generation
        self.prepared: dict[int, tuple[Any, Any, int]] = {}
        self.lock = threading.Condition()
        self.pumps: list[threading.Thread] = []
        self.closed = False
        self._codec: tokenizer.Codec | None = None

    # -------------------------------------------------------------------------------------- processes
    def start(self) -> None:
        # under the lock, as a restart is: a rank that loads before its state is recorded here (a warm start takes
        # 0.1 s) would have its "loaded" applied to nothing, and read STARTING for good
        with self.lock:
            for r in self.local:
                self.commands[r], self.procs[r] = self._start(r, self.spec, patient=self.joins_running_world)
                self.ranks[r] = RankState(pid=self.procs[r].pid)

    def _start(self, rank: int, spec: WorldSpec, standby: bool = False, patient: bool = False) -> tuple[Any, Any]:
        # one event queue per process: a process killed while writing to a queue can leave its lock held or its
        # pipe half-written, which must not silence the other ranks (a shared queue would)
        commands, events = self.ctx.Queue(), self.ctx.Queue()
        proc = self.ctx.Process(target=rank_main, args=(rank, spec, commands, events, standby, patient), daemon=True,
                                name=f"rank-{rank}")
        proc.start()
        pump = threading.Thread(target=self._pump, args=(events, proc), daemon=True, name=f"rank-{rank}-events")
        pump.start()
        self.pumps.append(pump)
        return commands, proc

    def restart_stuck(self, why: str) -> list[int]:
        """End the processes of the ranks still serving (or paused in) their world, which broke elsewhere (a
        peer's collective never completes): each is restarted as a standby like a crashed rank, `why` its error,
        and the requests of the groups it leads end as lost (a group whose leader stood by recomputes its
        requests in the next world). The ranks ended."""
        with self.lock:
            stuck = [r for r, st in sorted(self.ranks.items()) if st.state in ("serving", "paused") and r in self.procs]
            for r in stuck:
                self.ranks[r].error = why
                with contextlib.suppress(ProcessLookupError, TypeError):
                    os.kill(self.procs[r].pid, signal.SIGKILL)
        return stuck

    def poll_processes(self) -> list[tuple[int, int]]:
        """Mark rank processes that exited without being asked, schedule their restart with backoff, and
        restart those that are due. Returns [(rank, exit code)] newly found dead.

        A restarted rank comes back as a standby: it loads its weights and waits to be switched into a new
        world generation. It cannot rejoin the old one (its peers' collectives with the dead process failed);
        forming that generation without or with it is the recovery's job."""
        found = []
        now = time.monotonic()
        with self.lock:
            for r, p in list(self.procs.items()):
                st = self.ranks[r]
                if not p.is_alive() and st.state != "left" and st.restart_at is None and not self.closed:
                    # first sight of the dead process (its crash report, if it sent one, may have come first)
                    if st.state != "crashed":
                        st.state = "crashed" if p.exitcode else "exited"
                        self.crashes.append((r, st.error or f"exit code {p.exitcode}"))
                    st.exit_code = p.exitcode
                    st.error = st.error or f"exit code {p.exitcode}"
                    st.restart_at = now + RESTART_BACKOFF_S[min(st.restarts, len(RESTART_BACKOFF_S) - 1)]
                    found.append((r, p.exitcode or 0))
                    self._fail_led_by(r, st.error)
                elif st.state in ("crashed", "exited") and st.restart_at is not None and now >= st.restart_at:
                    self.commands[r], self.procs[r] = self._start(r, self.spec, standby=True)
                    self.ranks[r] = RankState(pid=self.procs[r].pid, restarts=st.restarts + 1,
                                              exit_code=st.exit_code, error=st.error)
            if found:
                self.lock.notify_all()
        return found

    # ----------------------------------------------------------------------------------------- events
    def _pump(self, events: Any, proc: Any) -> None:
        """Apply one process's events until the pool closes, or the process is gone and its queue is empty."""
        while not self.closed:
            try:
                ev = events.get(timeout=0.2)
            except queue.Empty:
                if not mp_connection.wait([proc.sentinel], 0):  # alive (the sentinel does not reap it)
                    continue
                self._ended_unheard(proc)
                return
            except (OSError, EOFError, ValueError):  # the writer died mid-message
                return
            with self.lock:
                try:
                    self._apply(ev)
                except Exception as e:  # a malformed event must not stop the pump
                    self.crashes.append((-1, f"event {ev[:2]!r} could not be applied: {e!r}"))
                self.lock.notify_all()

    def _ended_unheard(self, proc: Any) -> None:
        """A rank process that ended before it reported anything (killed while it loaded, or it could not start:
        its stderr says why) is a crash at once, so a wait for it fails now and not at its deadline."""
        with self.lock:
            rank = next((r for r, p in self.procs.items() if p is proc), None)
            if rank is None or self.closed or self.closing or self.ranks[rank].state != "starting":
                return
            proc.join(1)  # reap it: its exit code
            self._apply(("crashed", rank, f"its process ended (exit code {proc.exitcode}) before it reported "
                                          "anything"))
            self.lock.notify_all()

    def _apply(self, ev: tuple[Any, ...]) -> None:
        kind = ev[0]
        if kind == "loaded":
            self.loaded.add(ev[1])
            st = self.ranks.get(ev[1])
            if st is not None and st.state == "starting":
                st.state = "ready"  # weights loaded, waiting at its world's rendezvous
        elif kind == "standby" and ev[1] in self.ranks:
            self.ranks[ev[1]].state = "ready"
        elif kind == "broken" and ev[1] in self.ranks:  # its world failed; the process stands by, loaded
            st = self.ranks[ev[1]]
            st.state, st.error = "ready", ev[3]
            self.crashes.append((ev[1], ev[3]))
        elif kind == "ready":
            self.ready.setdefault(ev[2], set()).add(ev[1])
            st = self.ranks.setdefault(ev[1], RankState())
            st.state, st.join_seconds = "serving", ev[3]
        elif kind in ("token", "done", "refused"):
            p = self.pending.get(ev[1])
            if p is None:
                return
            if kind == "token":
                p.tokens.append(ev[2])
                now, latency = time.monotonic(), self.latency.setdefault(p.group, GroupLatency())
                if p.last_token_at is None:
                    latency.ttft.observe(now - p.queued_at)
                else:
                    latency.tpot.observe(now - p.last_token_at)
                p.last_token_at = now
            elif kind == "done":
                p.reason = ev[2]
                self.finished[ev[2]] = self.finished.get(ev[2], 0) + 1
                p.end()
            else:
                p.refused = ev[2]
                p.end()
            for listener in p.listeners:
                listener(kind, ev[2])
        elif kind == "left":  # the rank id is the one it had in the old world
            self.left.add(ev[1])
        elif kind == "migrated":
            self.migrations[ev[2]] = (ev[3], ev[4], ev[5])
        elif kind == "migration_refused":
            self.refusals.append(ev[3])
        elif kind in ("paused", "resumed") and ev[2] == self.spec.generation and ev[1] in self.ranks:
            if kind == "paused":
                self.paused_ranks.add(ev[1])
            else:
                self.paused_ranks.discard(ev[1])
            self.ranks[ev[1]].state = kind if kind == "paused" else "serving"
        elif kind == "crashed":
            self.crashes.append((ev[1], ev[2]))
            st = self.ranks.setdefault(ev[1], RankState())
            st.state, st.error = "crashed", ev[2]
            self._fail_led_by(ev[1], ev[2])
        elif kind == "lost":
            self._fail(ev[1], ev[2])
        elif kind == "stats":
            self.stats_replies.setdefault(ev[1], []).append(ev[2])

    def _fail(self, rid: str, why: str) -> None:
        """End a request with an explicit error (its group's state is gone). Holds the lock."""
        p = self.pending.get(rid)
        if p is None or p.done.is_set():
            return
        p.error, p.reason = why, "error"
        self.finished["error"] = self.finished.get("error", 0) + 1
        p.end()
        for listener in p.listeners:
            listener("error", why)

    def _fail_led_by(self, rank: int, error: str) -> None:
        """The requests of the groups a dead rank process led: its scheduler died with it. Holds the lock."""
        groups = {g for g in range(self.spec.dpa) if self.spec.leader(g) == rank}
        why = f"lost: rank {rank}, the leader of its DPA group, died ({error}); retry the request"
        for rid, p in list(self.pending.items()):
            if p.group in groups:
                self._fail(rid, why)

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str, *,
                 crash_fails: bool = True) -> None:
        """Wait for `predicate` with a deadline; a crash in the world ends the wait unless `crash_fails` is
        False (a request of a surviving group outlives its world: see `Rank.hold_requests`)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while not predicate():
                if self.crashes and crash_fails:
                    raise WorldError(f"rank {self.crashes[0][0]} crashed: {self.crashes[0][1]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorldError(f"timed out after {timeout:g} s waiting for {what}")
                self.lock.wait(min(left, 0.5))

    def wait_ready(self, timeout: float = 180) -> None:
        gen, want = self.spec.generation, set(self.local)
        self.wait_for(lambda: want <= self.ready.get(gen, set()), timeout, f"the local ranks of generation {gen}")

    # ---------------------------------------------------------------------------------------- serving
    def leader_groups(self) -> list[int]:
        """DPA groups whose leader rank runs in this pool."""
        return [g for g in range(self.spec.dpa) if self.spec.leader(g) in self.local]

    def in_flight(self, groups: list[int] | None = None) -> list[str]:
        with self.lock:
            return [rid for rid, p in self.pending.items()
                    if not p.done.is_set() and (groups is None or p.group in groups)]

    def pick_group(self) -> int:
        groups = self.leader_groups()
        if not groups:
            raise Refused("this pod leads no DPA group")
        load = {g: 0 for g in groups}
        with self.lock:
            for p in self.pending.values():
                if not p.done.is_set() and p.group in load:
                    load[p.group] += 1
        return min(groups, key=lambda g: (load[g], g))

    @property
    def codec(self) -> tokenizer.Codec:
        """The served model's tokenizer (bytes for the seeded presets), opened once."""
        if self._codec is None:
            self._codec = tokenizer.open_codec(self.spec.weights_dir)
        return self._codec

    def submit(self, prompt: str | list[int], max_tokens: int, group: int | None = None,
               rid: str | None = None, listener: Callable[[str, Any], None] | None = None, *,
               stop_ids: tuple[int, ...] | None = None, sampling: Sampling = GREEDY) -> str:
        """Queue a request on a DPA group this pool leads (the least loaded by default); returns its id. It ends
        on `max_tokens`, or with "stop" on one of `stop_ids` (default: the model's EOS tokens)."""
        ids = self.codec.encode(prompt) if isinstance(prompt, str) else list(prompt)
        stop = self.codec.eos_ids if stop_ids is None else stop_ids
        rid = rid or uuid.uuid4().hex[:16]
        g = self.pick_group() if group is None else group
        if self.spec.leader(g) not in self.local:
            raise Refused(f"DPA group {g} is not led by this pod")
        lead = self.ranks.get(self.spec.leader(g))
        if lead is not None and (lead.state in ("crashed", "exited") or (
                lead.error and lead.state not in ("serving", "paused"))):
            # its world broke: the leader restarts or stands by until the recovery's switch; a request queued
            # now would reach no scheduler (it is refused, so a router or client sends it elsewhere)
            raise Refused(f"DPA group {g} is recovering (its leader rank {self.spec.leader(g)} is {lead.state})")
        with self.lock:
            if self.closing:
                raise Refused("the pod is shutting down")
            self._forget_ended()
            old = self.pending.get(rid)
            if old is not None and not old.done.is_set():
                raise DuplicateRequest(f"request id {rid!r} is in flight (an id can be used again once its "
                                       "request has ended)")
            self.pending[rid] = Pending(group=g, listeners=[listener] if listener else [])
        self.commands[self.spec.leader(g)].put(("submit", rid, ids, max_tokens, tuple(stop), tuple(sampling)))
        return rid

    def _forget_ended(self) -> None:
        """Drop the requests that ended more than KEEP_ENDED_S ago (at most once a second). Holds the lock."""
        now = time.monotonic()
        if now - self._forgot_at < 1.0:
            return
        self._forgot_at = now
        for rid in [rid for rid, p in self.pending.items() if p.ended_at is not None
                    and now - p.ended_at > KEEP_ENDED_S]:
            del self.pending[rid]

    def result(self, rid: str, timeout: float = 120) -> dict[str, Any]:
        p = self.pending[rid]
        self.wait_for(p.done.is_set, timeout, f"request {rid}", crash_fails=False)
        if p.refused:
            raise Refused(p.refused)
        if p.error:
            raise WorldError(p.error)
        return {"id": rid, "token_ids": list(p.tokens), "text": self.codec.decode(p.tokens), "finish_reason": p.reason}

    def complete(self, prompt: str | list[int], max_tokens: int, group: int | None = None) -> dict[str, Any]:
        return self.result(self.submit(prompt, max_tokens, group))

    def abort(self, rid: str, group: int | None = None) -> bool:
        with self.lock:
            p = self.pending.get(rid)
        if p is None or p.done.is_set():
            return False
        g = p.group if group is None else group
        self.commands[self.spec.leader(g)].put(("abort", rid))
        return True

    def abort_groups(self, groups: list[int]) -> int:
        count = len(self.in_flight(groups))
        for g in groups:
            if self.spec.leader(g) in self.local:
                self.commands[self.spec.leader(g)].put(("abort_all",))
        return count

    def drain(self, groups: list[int], timeout: float) -> bool:
        """Stop admitting on `groups` and wait for their in-flight requests; False on timeout, and then
        admission is restored (the caller keeps serving at the old size)."""
        local = [g for g in groups if self.spec.leader(g) in self.local]
        for g in local:
            self.commands[self.spec.leader(g)].put(("drain",))
        try:
            self.wait_for(lambda: not self.in_flight(local), timeout, "drain")
            return True
        except WorldError:
            for g in local:
                self.commands[self.spec.leader(g)].put(("admit",))
            return False

    # ---------------------------------------------------------------------------------------- control
    def broadcast(self, *cmd: Any) -> None:
        for r in self.local:
            if self.ranks[r].state not in ("crashed", "exited"):
                self.commands[r].put(cmd)

    def pause(self, timeout: float = 60) -> None:
        self.broadcast("pause")
        want = set(self.local)
        self.wait_for(lambda: want <= self.paused_ranks, timeout, "every local rank to pause at a step boundary")

    def resume(self, timeout: float = 60) -> None:
        self.broadcast("resume")
        self.wait_for(lambda: not (self.paused_ranks & set(self.local)), timeout, "every local rank to resume")

    def stats(self, timeout: float = 30) -> list[dict[str, Any]]:
        key = uuid.uuid4().hex
        live = [r for r in self.local if self.ranks[r].state not in ("crashed", "exited")]
        for r in live:
            self.commands[r].put(("stats", key))
        # ranks standing by after a broken world answer too (their expert maps matter to the recovery)
        self.wait_for(lambda: len(self.stats_replies.get(key, [])) >= len(live), timeout, "rank statistics",
                      crash_fails=False)
        with self.lock:
            return sorted(self.stats_replies.pop(key, []), key=lambda s: s["rank"])

    def migrate(self, map_generation: int, phy2log: dict[int, list[int]],
                timeout: float = 120) -> tuple[int, int, float]:
        """Move experts to a new map while serving; returns (experts moved, bytes moved, seconds)."""
        with self.lock:
            self.migrations.pop(map_generation, None)
            self.refusals.clear()
        self.broadcast("migrate", map_generation, phy2log)
        try:
            self.wait_for(lambda: map_generation in self.migrations or bool(self.refusals), timeout, "migration")
        except WorldError:
            self.broadcast("cancel_migration", map_generation)  # e.g. not every pod was asked: do not hang
            raise
        if self.refusals:
            raise WorldError(self.refusals.pop())
        return self.migrations[map_generation]

    def _roles(self, new: WorldSpec, new_local: list[int] | None = None) -> dict[int, int | None]:
        """Local rank -> its rank in `new`, or None when it leaves. Without `new_local`: the same stage, group
        and TP rank. With it (this pod's ranks in `new`): each local rank takes the new local rank of the same
        stage and TP rank, groups in order, so a pod whose DPA group is renumbered (a lost group before it)
        keeps its processes, weights and KV caches; a pod without new ranks leaves."""
        c = self.spec.grid.coordinates()
        out: dict[int, int | None] = {}
        if new_local is None:
            for r in self.local:
                p, d, t = int(c["pp"][r]), int(c["dpa"][r]), int(c["tp"][r])
                out[r] = int(new.grid.grid[p, d, 0, t]) if p < new.pp and d < new.dpa and t < new.tp else None
            return out
        nc = new.grid.coordinates()
        free: dict[tuple[int, int], list[int]] = {}
        for n in sorted(new_local, key=lambda n: (int(nc["dpa"][n]), n)):
            free.setdefault((int(nc["pp"][n]), int(nc["tp"][n])), []).append(n)
        for r in sorted(self.local, key=lambda r: (int(c["dpa"][r]), r)):
            slot = free.get((int(c["pp"][r]), int(c["tp"][r])))
            out[r] = slot.pop(0) if slot else None
        return out

    def prepare(self, new: WorldSpec, new_local: list[int]) -> list[int]:
        """Phase 1: start the local ranks of roles the active world lacks. They load their weights while the
        old world keeps serving, then wait at the rendezvous of `new` for as long as the switch takes to come.
        A rank prepared for another generation (an operation rolled back, then tried again) is stopped and
        started afresh: it waits at a rendezvous no world will come to. Returns the ranks started."""
        for r, (_, proc, generation) in list(self.prepared.items()):
            if generation != new.generation or not proc.is_alive():
                del self.prepared[r]
                with self.lock:
                    self.loaded.discard(r)
                proc.terminate()  # blocked at its rendezvous: it reads no command
                _stop_process(proc, 5)
        taken = {n for n in self._roles(new, new_local).values() if n is not None}
        started = []
        for r in sorted(new_local):
            if r not in taken and r not in self.prepared:
                self.prepared[r] = (*self._start(r, new, patient=True), new.generation)
                started.append(r)
        return started

    def switch(self, new: WorldSpec, new_local: list[int]) -> None:
        """Phase 2: send every local rank to `new` (keeping its role, or leaving) and adopt the prepared ones.
        The ranks must be paused; they form the new world once every pod has switched."""
        self.prepare(new, new_local)
        roles = self._roles(new, new_local)
        commands, procs, ranks = {}, {}, {}
        for r_old, r_new in roles.items():
            self.commands[r_old].put(("switch", new, r_new))
            if r_new is not None:
                commands[r_new], procs[r_new], ranks[r_new] = self.commands[r_old], self.procs[r_old], self.ranks[r_old]
            else:
                self.left.discard(r_old)
                self.retired.append((self.commands[r_old], self.procs[r_old], r_old))
        for r, (q, proc, _) in self.prepared.items():
            commands[r], procs[r], ranks[r] = q, proc, RankState(pid=proc.pid)
        with self.lock:
            self.paused_ranks = {n for r in self.paused_ranks if (n := roles.get(r)) is not None}
            # a request follows its group's leader process into the new world (its group may be renumbered);
            # a group whose leader leaves ends its requests (a scale-down drains or aborts them first)
            nc = new.grid.coordinates()
            for rid, p in list(self.pending.items()):
                if p.done.is_set():
                    continue
                lead = roles.get(self.spec.leader(p.group))
                if lead is None:
                    self._fail(rid, f"lost: DPA group {p.group} left with generation {self.spec.generation}")
                else:
                    p.group = int(nc["dpa"][lead])
            self.spec, self.local = new, sorted(new_local)
            self.commands, self.procs, self.ranks = commands, procs, ranks
            self.prepared = {}
            self.crashes = []  # recovery: the broken world's failures are settled by the new one
            self.lock.notify_all()

    def not_standing_by(self) -> list[int]:
        """Local ranks not yet loaded and waiting as standbys (after a crash they restart with backoff)."""
        with self.lock:
            return sorted(r for r, st in self.ranks.items() if st.state != "ready" or r not in self.procs
                          or not self.procs[r].is_alive())

    def release_retired(self, timeout: float = 30) -> None:
        """Stop the processes of ranks that left the world, once they have left it: a stop sent earlier would
        reach the old world's last control exchange and stop every rank in it."""
        with self.lock:
            batch, self.retired = self.retired, []  # a later switch may retire more meanwhile
            deadline = time.monotonic() + timeout
            while not all(r in self.left or not p.is_alive() for _, p, r in batch):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.lock.wait(min(left, 0.5))
        for q, _, _ in batch:
            q.put(("stop",))
        for _, p, _ in batch:
            _stop_process(p, timeout)

    def close(self, timeout: float = 30) -> None:
        """Stop every rank: ask those in a world (they leave it together) and terminate the others at once (one
        still loading or waiting at a rendezvous reads no command, and none has work to finish), then terminate
        and kill by PID what did not exit. Requests still in flight end at once with an explicit error (their
        client, or the router, hears it now, not when the process goes)."""
        with self.lock:
            self.closing = True  # new requests are refused from now on (a router sends them elsewhere)
            for rid in list(self.pending):
                self._fail(rid, "lost: the pod is shutting down (its ranks stopped before the request finished); "
                                "retry the request")
            idle = {r for r in self.local if r in self.ranks and self.ranks[r].state not in ("serving", "paused")}
        for r in self.local:
            if r in idle and r in self.procs:
                self.procs[r].terminate()
            else:
                self.commands[r].put(("stop",))
        for q, _, _ in self.retired:
            q.put(("stop",))
        for _, p, _ in self.prepared.values():  # blocked at a rendezvous that will not happen: no need to ask
            p.terminate()
        deadline = time.monotonic() + timeout
        for p in [*self.procs.values(), *(p for _, p, _ in self.retired), *(p for _, p, _ in self.prepared.values())]:
            _stop_process(p, max(0.5, deadline - time.monotonic()))
        self.retired = []
        self.closed = True
        for pump in self.pumps:
            pump.join(2)

    def pids(self) -> Iterator[int]:
        return (p.pid for p in self.procs.values() if p.pid is not None)


def _stop_process(p: Any, timeout: float) -> None:
    if p.pid is None:
        return
    p.join(timeout)
    if p.is_alive():
        p.terminate()
        p.join(5)
    if p.is_alive():
        p.kill()
        p.join(5)


class LocalWorld(RankPool):
    """Every rank of a world on this machine, with the rendezvous store: tests and `shardwise run`."""

    def __init__(self, spec_args: dict[str, Any], *, host: str = "127.0.0.1", start: bool = True) -> None:
        self.store = serve_store(host)
        spec = WorldSpec(store_host=host, store_port=self.store.port, **spec_args)
        super().__init__(spec, list(range(spec.world_size)))
        if start:
            self.start()

    def change_world(self, dpa: int, timeout: float = 180, **spec_changes: Any) -> float:
        """Form a new world generation with `dpa` attention groups in the same processes (and new ones for
        new groups), in two phases: prepare (new ranks start and load their weights while the old world
        serves), then pause, switch, resume. Leaving groups must be idle. Returns the pause in seconds."""
        new = dataclasses.replace(self.spec, generation=self.spec.generation + 1, dpa=dpa, **spec_changes)
        new_ranks = self.prepare(new, list(range(new.world_size)))
        self.wait_for(lambda: all(self._loaded(r) for r in new_ranks), timeout, "the new ranks to load their weights")
        started = time.monotonic()
        self.pause(timeout)
        self.switch(new, list(range(new.world_size)))
        self.wait_ready(timeout)
        self.resume(timeout)
        self.last_pause_seconds = time.monotonic() - started
        self.release_retired()
        return self.last_pause_seconds

    def _loaded(self, rank: int) -> bool:
        return rank in self.loaded

    def __enter__(self) -> LocalWorld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
