"""The router's choice of a DPA group, as a table of situations: the least outstanding work, what the groups
report (waiting requests, a full KV cache, not admitting, stale reports), refusals, round-robin, prefix
affinity with headroom; and the route table's validation."""

from __future__ import annotations

from typing import Any

import pytest
from shardwise.agents import openai_api as oai
from shardwise.agents.router import AFFINITY_CHARS, Options, Router, estimate_work


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def router(n: int = 3, **options: Any) -> tuple[Router, Clock]:
    clock = Clock()
    r = Router(Options(**options), clock=clock)
    r.set_routes({"model": "m", "groups": [{"group": g, "url": f"http://10.0.0.{g}:8000"} for g in range(n)]})
    return r, clock


def report(r: Router, clock: Clock, group: int, *, queue: int = 0, kv: float = 0.0, admitting: bool = True) -> None:
    g = r.groups[group]
    g.queue_depth, g.kv_usage, g.reported_admitting, g.polled_at = queue, kv, admitting, clock()


def pick(r: Router, work: int = 10, key: str = "", tried: set[int] | None = None) -> int | None:
    g = r.choose(tried or set(), work, key)
    return None if g is None else g.group


def test_the_least_outstanding_work_wins_and_ties_rotate() -> None:
    r, _ = router()
    assert [pick(r) for _ in range(3)] == [0, 1, 2]  # each now holds 10 tokens
    r.release(r.groups[1], 10, "200", 0.1)
    assert pick(r, work=500) == 1  # the one that finished
    assert pick(r) in (0, 2)


@pytest.mark.parametrize(("reports", "want"), [
    pytest.param({0: {"queue": 2}}, 1, id="waiting requests count against a group"),
    pytest.param({0: {"kv": 0.99}}, 1, id="a nearly full KV cache counts against a group"),
    pytest.param({0: {"admitting": False}}, 1, id="a group that reports not admitting is skipped"),
])
def test_what_the_groups_report_steers_the_choice(reports: dict[int, dict[str, Any]], want: int) -> None:
    r, clock = router(2)
    for g, kw in reports.items():
        report(r, clock, g, **kw)
    assert pick(r) == want


def test_a_reported_queue_counts_only_the_requests_this_router_did_not_send(monkeypatch: pytest.MonkeyPatch) -> None:
    # a short request waiting in idle group 1's queue when the poll ran is already in its work: once it is
    # answered, group 1 is idle again and must win over group 0's long request (it lost to it for a poll period)
    r, _ = router(2)
    long = r.choose(set(), 121, "")
    short = r.choose(set(), 4, "")
    assert (long and long.group, short and short.group) == (0, 1)
    queues = {"http://10.0.0.0:8000": 0, "http://10.0.0.1:8000": 1}
    monkeypatch.setattr("shardwise.agents.router._get_json", lambda url, timeout, token="": {
        "groups": [{"dpaGroup": int(url.split(":")[1][-1]), "queueDepth": queues[url.removesuffix("/v1/stats")]}]})
    r.poll_once()
    r.release(short, 4, "200", 0.1)
    assert pick(r) == 1
    queues["http://10.0.0.1:8000"] = 2  # two waiting there that some other client sent: group 1 is the busier
    r.poll_once()
    assert pick(r) == 0


def test_a_stale_report_is_ignored() -> None:
    r, clock = router(2)
    report(r, clock, 0, admitting=False)
    clock.t += 5  # older than STALE_S
    assert pick(r) == 0


def test_not_admitting_refused_and_tried_groups_get_nothing() -> None:
    r, clock = router(3)
    r.set_routes({"groups": [{"group": 0, "url": "http://10.0.0.0:8000", "admitting": False},
                             {"group": 1, "url": "http://10.0.0.1:8000"}, {"group": 2, "url": "http://10.0.0.2:8000"}]})
    r.refused(r.groups[1], "connect", 1.0)
    assert pick(r) == 2
    assert pick(r, tried={2}) is None
    clock.t += 0.15  # the first refusal's cool-off (0.1 s) is over
    assert pick(r, tried={2}) == 1
    assert r.retries == {"connect": 1}


def test_a_refused_group_is_tried_again_after_a_pause_that_doubles_and_resets_once_it_answers() -> None:
    r, clock = router(1)
    g, waits = r.groups[0], []
    for _ in range(6):  # a group that stays down: 0.1, 0.2, 0.4, 0.8 s, then its Retry-After of 1 s
        r.refused(g, "connect", 1.0)
        waits.append(round(g.refused_until - clock.t, 3))
        clock.t = g.refused_until
    assert waits == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    r.release(g, 0, "200", 0.1)  # it answered: back from a recovery, a refusal pauses it 0.1 s again
    r.refused(g, "unavailable", 0.25)
    assert round(g.refused_until - clock.t, 3) == 0.1
    assert pick(r) is None
    clock.t += 0.1
    assert pick(r) == 0


def test_a_group_of_a_new_world_is_tried_at_once_whatever_it_refused_or_reported_before() -> None:
    r, clock = router(2)
    r.set_routes({"world": 5, "groups": [{"group": 0, "url": "http://10.0.0.0:8000"},
                                         {"group": 1, "url": "http://10.0.0.1:8000"}]})
    for _ in range(3):  # 503s while the survivors re-form: 0.1, 0.2 then 0.25 s apart
        r.refused(r.groups[0], "unavailable", 0.25)
    report(r, clock, 0, admitting=False)  # its last poll saw it switching
    assert pick(r, tried={1}) is None
    r.set_routes({"world": 6, "groups": [{"group": 0, "url": "http://10.0.0.0:8000"}]})  # the survivors serve
    assert pick(r) == 0
    r.refused(r.groups[0], "unavailable", 0.25)
    assert round(r.groups[0].refused_until - clock.t, 3) == 0.1  # the backoff starts again
    r.set_routes({"world": 6, "groups": [{"group": 0, "url": "http://10.0.0.0:8000"}]})  # the same table again
    assert pick(r) is None  # changes nothing


def test_round_robin_ignores_load() -> None:
    r, _ = router(3, policy="round-robin")
    r.groups[0].work = 10_000
    assert [pick(r) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_prefix_affinity_sticks_while_the_group_has_headroom() -> None:
    r, _ = router(3, prefix_affinity=True)
    key = "x" * AFFINITY_CHARS
    first = pick(r, key=key)
    assert [pick(r, key=key) for _ in range(5)] == [first] * 5
    r.groups[first].work += 10_000  # busy beyond the headroom: the least loaded group takes it
    assert pick(r, key=key) != first
    assert len({pick(r, key=f"short {i}") for i in range(6)}) > 1  # under one block: no affinity


def test_a_renumbered_group_moves_to_its_new_pod() -> None:
    r, _ = router(2)
    old = r.groups[1]
    r.set_routes({"groups": [{"group": 0, "url": "http://10.0.0.0:8000"}, {"group": 1, "url": "http://10.0.0.9:8000"}]})
    assert r.groups[1] is not old and r.groups[1].url == "http://10.0.0.9:8000"
    r.set_routes({"groups": [{"group": 0, "url": "http://10.0.0.0:8000"}]})
    assert set(r.groups) == {0}


@pytest.mark.parametrize("table", [
    pytest.param({}, id="no groups"),
    pytest.param({"groups": [{"group": "0", "url": "http://a:8000"}]}, id="a group that is not a number"),
    pytest.param({"groups": [{"group": 0, "url": "https://a:8000"}]}, id="not plain http"),
    pytest.param({"groups": [{"group": 0, "url": "http://a"}]}, id="no port"),
    pytest.param({"groups": [{"group": 0, "url": "http://http://a:8000"}]}, id="a doubled scheme"),
])
def test_a_bad_route_table_is_refused(table: dict[str, Any]) -> None:
    r, _ = router(1)
    with pytest.raises(oai.ApiError) as e:
        r.set_routes(table)
    assert e.value.status == 400
    assert set(r.groups) == {0}  # the table in force is kept


@pytest.mark.parametrize(("body", "work"), [
    pytest.param({"prompt": "abcdefgh", "max_tokens": 10}, 13, id="prompt characters / 4 + 1 + max_tokens"),
    pytest.param({"prompt": [1, 2, 3], "max_tokens": 5}, 8, id="token ids count one each"),
    pytest.param({"prompt": "abcd", "max_tokens": 4, "n": 3}, 18, id="n choices"),
    pytest.param({"messages": [{"role": "user", "content": "abcdefgh"}]}, 19, id="chat, default 16 tokens"),
])
def test_the_work_estimate(body: dict[str, Any], work: int) -> None:
    assert estimate_work(body)[0] == work
