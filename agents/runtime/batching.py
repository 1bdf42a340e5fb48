"""Continuous batching for one DPA group, run by the group's leader rank.

Each step the leader takes every running request's next token (decode) and admits waiting requests whose
whole prompt fits the step's token budget (prefill), oldest first. A request keeps its KV cache on the
group's ranks from admission to completion; it finishes on `max_tokens` ("length"), on EOS ("stop"), or by
abort ("aborted"). A running request whose KV cache was lost (a rank of its group restarted) is recomputed:
its prompt and the tokens it generated run again as one prefill, when they fit a step's budget, and it goes
on from there with no token emitted twice. The scheduler is plain Python with no torch: the rank process
applies its decisions.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

Sampling = tuple[float, float, int, int]  # temperature (0: greedy), top_p, top_k (0: all), seed


GREEDY: Sampling = (0.0, 1.0, 0, 0)


@dataclass
class Request:
    rid: str
    prompt: list[int]
    max_tokens: int
    stop_ids: frozenset[int] = frozenset()  # tokens that end the request ("stop"), e.g. the model's EOS
    sampling: Sampling = GREEDY
    generated: list[int] = field(default_factory=list)
    admitted: bool = False

    @property
    def next_feed(self) -> tuple[list[int], int]:
        """(tokens to run, position of the first) for this request's next step: the prompt at admission, all
        of it and what was generated when recomputed, else the last token."""
        if not self.admitted:
            return [*self.prompt, *self.generated], 0
        return [self.generated[-1]], len(self.prompt) + len(self.generated) - 1


@dataclass(frozen=True)
class Feed:
    rid: str
    tokens: tuple[int, ...]
    start: int
    sampling: Sampling = GREEDY


@dataclass(frozen=True)
class Finished:
    rid: str
    reason: str  # length | stop | aborted


class Scheduler:
    def __init__(self, *, max_batch_tokens: int, max_running: int, max_waiting: int) -> None:
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.admitting = True

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def submit(self, req: Request) -> str | None:
        """Queue a request; returns a refusal reason instead when the group cannot take it."""
        if not self.admitting:
            return "draining: not admitting requests"
        if len(req.prompt) > self.max_batch_tokens:
            return f"prompt of {len(req.prompt)} tokens exceeds maxBatchTokens={self.max_batch_tokens}"
        if len(self.waiting) >= self.max_waiting:
            return f"queue full ({self.max_waiting} waiting)"
        self.waiting.append(req)
        return None

    def abort(self, rid: str) -> Finished | None:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                return Finished(rid, "aborted")
        if self.running.pop(rid, None) is not None:
            return Finished(rid, "aborted")
        return None

    def abort_all(self) -> list[Finished]:
        return [f for rid in [r.rid for r in self.waiting] + list(self.running) if (f := self.abort(rid))]

    def recompute(self) -> list[str]:
        """The running requests' KV caches are gone: each runs its prompt and generated tokens again as one
        prefill before its next token. Returns the requests that can never fit a step's budget (they are
        dropped: the caller ends them)."""
        dropped = []
        for rid, req in list(self.running.items()):
            if len(req.prompt) + len(req.generated) > self.max_batch_tokens:
                del self.running[rid]
                dropped.append(rid)
            else:
                req.admitted = False
        return dropped

    def next_batch(self) -> list[Feed]:
        """This step's feeds: every running request's next token, then recomputed requests and waiting ones
        (oldest first) while their tokens fit the budget; a recomputed request that does not fit waits for the
        next step."""
        running = list(self.running.values())
        feeds = [Feed(r.rid, tuple(r.next_feed[0]), r.next_feed[1], r.sampling) for r in running if r.admitted]
        budget = self.max_batch_tokens - len(feeds)
        for r in running:
            if not r.admitted and len(r.prompt) + len(r.generated) <= budget:
                tokens, start = r.next_feed
                feeds.append(Feed(r.rid, tuple(tokens), start, r.sampling))
                budget -= len(tokens)
        while self.waiting and len(self.running) < self.max_running and len(self.waiting[0].prompt) <= budget:
            req = self.waiting.popleft()
            budget -= len(req.prompt)
            feeds.append(Feed(req.rid, tuple(req.prompt), 0, req.sampling))
            self.running[req.rid] = req
        return feeds

    def record(self, sampled: dict[str, int]) -> tuple[list[tuple[str, int]], list[Finished]]:
        """Apply one step's sampled tokens; returns (emitted tokens, finished requests)."""
        emitted, finished = [], []
        for rid, token in sampled.items():
            req = self.running.get(rid)
            if req is None:  # aborted while its step ran
                continue
            req.admitted = True
            req.generated.append(token)
            emitted.append((rid, token))
            if token in req.stop_ids or len(req.generated) >= req.max_tokens:
                del self.running[rid]
                finished.append(Finished(rid, "stop" if token in req.stop_ids else "length"))
        return emitted, finished

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
