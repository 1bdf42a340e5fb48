"""The leader's continuous batching: what a step runs, and a running request recomputed after its KV cache was
lost (a rank of its group restarted), which goes on without a token sent twice."""

from __future__ import annotations

from shardwise.agents.runtime.batching import Feed, Request, Scheduler


def scheduler(budget: int = 16) -> Scheduler:
    return Scheduler(max_batch_tokens=budget, max_running=8, max_waiting=8)


def test_a_step_decodes_the_running_requests_and_admits_the_waiting_ones_that_fit() -> None:
    s = scheduler(budget=8)
    for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6, 7]), ("c", [8, 9])):
        assert s.submit(Request(rid, prompt, 4)) is None
    assert s.next_batch() == [Feed("a", (1, 2, 3), 0), Feed("b", (4, 5, 6, 7), 0)]  # c waits: 7 of 8 used
    assert s.record({"a": 10, "b": 11}) == ([("a", 10), ("b", 11)], [])
    assert s.next_batch() == [Feed("a", (10,), 3), Feed("b", (11,), 4), Feed("c", (8, 9), 0)]


def test_a_recomputed_request_runs_its_prompt_and_tokens_again_then_goes_on() -> None:
    s = scheduler()
    s.submit(Request("a", [1, 2, 3], 4))
    s.next_batch()
    s.record({"a": 10})
    s.next_batch()
    s.record({"a": 11})
    assert s.recompute() == []
    assert s.next_batch() == [Feed("a", (1, 2, 3, 10, 11), 0)]  # one prefill: the cache is rebuilt
    emitted, finished = s.record({"a": 12})
    assert emitted == [("a", 12)] and not finished  # 10 and 11 are not sent again
    assert s.next_batch() == [Feed("a", (12,), 5)]
    assert s.record({"a": 13})[1][0].reason == "length"  # max_tokens counts the tokens before the loss too


def test_recomputing_waits_for_room_in_the_budget_and_a_request_that_never_fits_is_dropped() -> None:
    s = scheduler(budget=8)
    for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [7])):
        s.submit(Request(rid, prompt, 8))
    s.next_batch()
    s.record({"a": 10, "b": 11, "c": 12})
    s.next_batch()
    s.record({"a": 13, "b": 14, "c": 15})
    assert s.recompute() == []
    # a: 5 tokens, b: 5 more would pass 8; c (3) still fits after a
    assert s.next_batch() == [Feed("a", (1, 2, 3, 10, 13), 0), Feed("c", (7, 12, 15), 0)]
    s.record({"a": 16, "c": 17})
    assert s.next_batch() == [Feed("a", (16,), 5), Feed("c", (17,), 3), Feed("b", (4, 5, 6, 11, 14), 0)]
    s.record({"a": 18, "b": 19, "c": 20})
    for _ in range(3):
        s.next_batch()
        s.record({"a": 1, "b": 1, "c": 1})
    assert s.recompute() == ["a", "b"]  # 3 + 7 and 3 + 6 tokens pass a step's 8; c (1 + 7) fits
    assert list(s.running) == ["c"]
