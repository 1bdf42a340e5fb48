"""Warm rank starts: a forkserver that imports torch and the engine once, so that every rank process of the pod
forks from it in about 0.1 s. Imports neither itself: `shardwise agent` starts the forkserver before it imports the
agent (which imports torch too), so that the two imports run at the same time on a new pod."""

from __future__ import annotations

import multiprocessing as mp

RANK_PRELOAD = ["torch", "shardwise.agents.runtime.engine"]  # what a forked rank process finds imported


def warm_rank_starts() -> str:
    """Start this process's forkserver now, importing torch and the engine once in it: every rank process started
    later (the first world's, a crashed rank's restart, a scale-up's new ranks) is then forked from it in about
    0.1 s instead of importing torch itself (about 2 s on 2 cores, more on a busy node). Returns the start method
    for `RankPool`: "forkserver", or "spawn" where there is none. Call it before the first rank starts; the
    forkserver ends when this process does, and its ranks with it (each rank asks the kernel for that)."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    from multiprocessing import forkserver

    mp.set_forkserver_preload(RANK_PRELOAD)
    forkserver.ensure_running()  # returns at once; the server imports RANK_PRELOAD before its first fork
    return "forkserver"


def _started() -> None:
    """What `wait_warm`'s probe process runs: nothing."""


def wait_warm() -> None:
    """Return once a rank process starts warm: one process that does nothing is forked through the forkserver
    (`warm_rank_starts` returned "forkserver"), which takes it only after importing RANK_PRELOAD (a few seconds
    after its start on a busy node)."""
    probe = mp.get_context("forkserver").Process(target=_started, daemon=True, name="warm-probe")
    probe.start()
    probe.join()
