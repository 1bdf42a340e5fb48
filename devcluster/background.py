"""An asyncio program run in a background thread, started and stopped from synchronous code.

A subclass implements `_main()`: it calls `self._mark_ready()` once it serves, then awaits `self._stopped()`
and cleans up. `start()` waits for readiness (re-raising a startup failure), `stop()` wakes `_main` through
its own loop and joins the thread. Shared by the API server and the process-backed nodes.
"""

from __future__ import annotations

import abc
import asyncio
import threading


class BackgroundLoop(abc.ABC):
    label = "background loop"  # for messages: "the API server", "the nodes"

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None

    @abc.abstractmethod
    async def _main(self) -> None:
        """The program: serve, `_mark_ready()`, `await self._stopped()`, clean up."""

    def _mark_ready(self) -> None:
        self._ready.set()

    async def _stopped(self) -> None:
        assert self._stopping is not None
        await self._stopping.wait()

    def _start_thread(self, timeout: float, name: str) -> None:
        """Run `_main` in a new thread; raise RuntimeError if it failed, TimeoutError if it was not ready."""
        if self._thread is not None:
            raise RuntimeError(f"{self.label} is already started")
        self._failure = None
        self._ready.clear()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        ready = self._ready.wait(timeout)
        if ready and self._failure is None:
            return
        failure = self._failure
        self.stop()
        if failure is not None:
            raise RuntimeError(f"{self.label} failed to start: {failure}") from failure
        raise TimeoutError(f"{self.label} was not ready within {timeout} s")

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        if self._loop is not None and self._stopping is not None and not self._loop.is_closed():
            # a loop that already ended (its main failed at start) is not signalled: its error stays visible
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.label} did not stop within {timeout} s")
        self._thread = None

    def _run(self) -> None:
        try:
            asyncio.run(self._enter())
        except BaseException as e:  # reported by start(); the thread then ends
            self._failure = e
        finally:
            self._ready.set()

    async def _enter(self) -> None:
        self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
        await self._main()
