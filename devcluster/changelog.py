"""The emulator's revision counter and its retained history of changes, which watches read.

Every write takes the next revision of one global counter (the object's `metadata.resourceVersion`) and appends
one `Change`. The log keeps the last `limit` changes: a watch from revision R replays the retained changes after R
and then follows new ones; when changes after R have already been dropped, R is too old (`Expired`, which the API
answers with 410 Gone, as Kubernetes does once etcd has compacted a revision).

All of it runs on the server's one event loop: `append` is synchronous, so a write and its change are recorded in
one step that no request can observe half-done; waiting watches are woken through an `asyncio.Event`.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import itertools
from dataclasses import dataclass
from typing import Any

import kmock


class Expired(Exception):
    """The changes after a revision are no longer retained."""

    def __init__(self, revision: int, oldest: int) -> None:
        super().__init__(f"too old resource version: {revision} ({oldest})")


@dataclass(frozen=True)
class Change:
    revision: int
    resource: kmock.resource
    type: str  # ADDED, MODIFIED or DELETED
    object: dict[str, Any]
    previous: dict[str, Any] | None  # the object before a MODIFIED change: selectors compare both


class ChangeLog:
    def __init__(self, limit: int) -> None:
        self.revision = 0
        self.closed = False
        self._changes: collections.deque[Change] = collections.deque(maxlen=limit)
        self._compacted = 0  # the revision of the newest dropped change
        self._changed = asyncio.Event()

    def next_revision(self) -> int:
        self.revision += 1
        return self.revision

    def append(self, change: Change) -> None:
        if len(self._changes) == self._changes.maxlen:
            self._compacted = self._changes[0].revision
        self._changes.append(change)
        self._wake()

    def since(self, revision: int) -> list[Change]:
        """The retained changes after `revision`; Expired when some of them were dropped."""
        if revision < self._compacted:
            raise Expired(revision, self._compacted + 1)
        start = bisect.bisect_right(self._changes, revision, key=lambda change: change.revision)
        return list(itertools.islice(self._changes, start, None))

    async def wait(self, revision: int, timeout: float | None) -> None:
        """Return when a change after `revision` is recorded, the log closes, or `timeout` seconds pass."""
        if self.revision > revision or self.closed:
            return
        with contextlib.suppress(TimeoutError):  # asyncio.timeout: wait_for can swallow a cancellation on 3.11
            async with asyncio.timeout(timeout):
                await self._changed.wait()

    def close(self) -> None:
        """Wake every waiting watch for good: the server is stopping."""
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
