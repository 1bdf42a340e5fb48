"""The autoscaler: the policy (scale up at once, down after the stabilisation window, hold in the cooldown, clamp to
the elastic bounds), the default PromQL load, and reading a load from the Prometheus HTTP API."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from shardwise.controllers.autoscaler import (
    Autoscaler,
    Decision,
    PrometheusError,
    default_query,
    load_query,
    query_prometheus,
)

from shardwise.api import AutoscalingSpec

# ---------------------------------------------------------------------------------------------------- policy

BOUNDS = {"target_per_dpa": 8.0, "min_dpa": 1, "max_dpa": 8, "stabilization_s": 60.0, "cooldown_s": 0.0}


@dataclass
class Step:
    """One pass: at `now` the load is `value` while `current` groups run; `expect` is (action, desired)."""

    now: float
    value: float
    current: int
    expect: tuple[str, int]
    last_scale_time: float | None = None
    options: dict[str, Any] = field(default_factory=dict)


def run(steps: list[Step], history: list[tuple[float, int]] | None = None) -> list[Decision]:
    scaler = Autoscaler(list(history or []))
    decisions = []
    for s in steps:
        d = scaler.decide(s.now, s.value, s.current, **{**BOUNDS, **s.options}, last_scale_time=s.last_scale_time)
        assert (d.action, d.desired) == s.expect, f"at t={s.now}: {d.reason}"
        decisions.append(d)
    return decisions


SCENARIOS = {
    "a load above the target scales up at once to the newest recommendation": [
        Step(0, 8, 1, ("hold", 1)),
        Step(15, 30, 1, ("up", 4)),
        Step(30, 50, 4, ("up", 7)),
    ],
    "a sustained low load scales down only once the window holds no higher recommendation": [
        Step(0, 40, 5, ("hold", 5)),
        Step(15, 10, 5, ("hold", 5)),
        Step(59, 10, 5, ("hold", 5)),
        Step(60, 10, 5, ("hold", 5)),  # t=0 is still exactly 60 s old: inside the window
        Step(75, 10, 5, ("down", 2)),
    ],
    "a dip shorter than the window does not shrink the deployment": [
        Step(0, 32, 4, ("hold", 4)),
        Step(15, 0, 4, ("hold", 4)),
        Step(30, 0, 4, ("hold", 4)),
        Step(45, 32, 4, ("hold", 4)),
        Step(60, 0, 4, ("hold", 4)),
        Step(90, 0, 4, ("hold", 4)),  # the 4 of t=45 is still in the window
    ],
    "a scale-down goes to the highest recommendation of the window, not the newest": [
        Step(0, 48, 6, ("hold", 6)),
        Step(30, 24, 6, ("hold", 6)),
        Step(61, 8, 6, ("down", 3)),  # t=0's 6 expired, t=30's 3 remains
    ],
    "zero load brings the deployment to minDpa after the window": [
        Step(0, 0, 4, ("hold", 4), options={"min_dpa": 3}),
        Step(30, 0, 4, ("hold", 4), options={"min_dpa": 3}),
        Step(61, 0, 4, ("down", 3), options={"min_dpa": 3}),
    ],
    "a window of zero scales down at once": [
        Step(0, 0, 4, ("down", 1), options={"stabilization_s": 0}),
    ],
    "a current size above maxDpa is brought down to maxDpa without waiting for the window": [
        Step(0, 200, 12, ("down", 8)),
    ],
    "a current size below minDpa is brought up to minDpa at once": [
        Step(0, 0, 1, ("up", 2), options={"min_dpa": 2}),
    ],
}


@pytest.mark.parametrize("steps", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_policy_scenarios(steps: list[Step]) -> None:
    run(steps)


def test_a_fresh_autoscaler_counts_the_current_size_as_recommended_so_a_restart_never_shrinks_at_once() -> None:
    (d,) = run([Step(100, 0, 4, ("hold", 4))])
    assert "no history yet: the current 4 counts as recommended now" in d.reason


def test_a_persisted_history_rebuilds_the_same_decisions_after_a_restart() -> None:
    first = Autoscaler()
    first.decide(0, 40, 5, **BOUNDS, last_scale_time=None)
    first.decide(30, 10, 5, **BOUNDS, last_scale_time=None)
    persisted = json.loads(json.dumps(first.history))  # as the caller stores it: lists, not tuples
    # the 5 of t=0 is still in the window at t=45: a restarted autoscaler must hold too
    run([Step(45, 10, 5, ("hold", 5)), Step(61, 10, 5, ("down", 2))], history=persisted)


def test_the_persisted_history_is_short_and_restores_every_decision_of_the_full_one() -> None:
    """What the operator writes to status.autoscaling.history: at most one entry per size, and an autoscaler
    rebuilt from it at any moment decides what the one that never stopped decides, for a thousand random loads."""
    import random

    rng = random.Random(7)
    live = Autoscaler()
    current, now = 3, 1000.0
    for _ in range(1000):
        now += rng.choice([1.0, 5.0, 15.0, 40.0])
        value = rng.uniform(0, 70)
        restored = Autoscaler(history=json.loads(json.dumps(live.persisted())))
        assert len(live.persisted()) <= BOUNDS["max_dpa"]
        a = live.decide(now, value, current, **BOUNDS, last_scale_time=None)
        b = restored.decide(now, value, current, **BOUNDS, last_scale_time=None)
        assert (a.action, a.desired) == (b.action, b.desired), (now, a.reason, b.reason)
        current = a.desired


def test_recommendations_older_than_the_window_are_dropped_from_the_history() -> None:
    scaler = Autoscaler([(0.0, 5), (50.0, 3)])
    scaler.decide(100, 8, 5, **BOUNDS, last_scale_time=None)
    assert scaler.history == [(50.0, 3), (100.0, 1)]


def test_the_cooldown_holds_any_change_and_says_how_long_is_left() -> None:
    (d,) = run([Step(100, 64, 2, ("hold", 2), last_scale_time=70, options={"cooldown_s": 120})])
    assert "cooldown, 90 s left of 120 s" in d.reason
    assert "would scale up to 8" in d.reason
    assert d.recommendation == 8


def test_after_the_cooldown_the_held_scale_up_happens() -> None:
    run([Step(100, 64, 2, ("hold", 2), last_scale_time=70, options={"cooldown_s": 120}),
         Step(190, 64, 2, ("up", 8), last_scale_time=70, options={"cooldown_s": 120})])


REASONS = {
    "the load, the target and the raw recommendation": (Step(0, 20, 3, ("hold", 3)),
                                                        "load 20 / target 8 per group = 2.5 -> raw 3"),
    "a recommendation above maxDpa is clamped to it": (Step(0, 100, 8, ("hold", 8)), "raw 13, clamped to maxDpa 8"),
    "a recommendation below minDpa is raised to it": (Step(0, 1, 2, ("hold", 2), options={"min_dpa": 2}),
                                                      "raw 1, raised to minDpa 2"),
    "the window's highest recommendation": (Step(0, 8, 3, ("hold", 3)), "highest over the 60 s window: 3"),
    "a scale-up": (Step(0, 40, 3, ("up", 5)), "scale up 3 -> 5 at once"),
}


@pytest.mark.parametrize(("step", "text"), REASONS.values(), ids=REASONS.keys())
def test_the_reason_gives_the_numbers(step: Step, text: str) -> None:
    (d,) = run([step])
    assert text in d.reason
    assert d.value == step.value


def test_an_exact_multiple_of_the_target_is_not_rounded_up_by_float_error() -> None:
    (d,) = run([Step(0, 0.1 + 0.2, 3, ("hold", 3), options={"target_per_dpa": 0.1, "max_dpa": 8})])
    assert d.recommendation == 3  # 0.30000000000000004 / 0.1 is 3 groups, not 4


@pytest.mark.parametrize(("value", "options"), [(float("nan"), {}), (float("inf"), {}), (1, {"min_dpa": 0}),
                                                (1, {"min_dpa": 5, "max_dpa": 4}), (1, {"target_per_dpa": 0})])
def test_impossible_inputs_are_refused(value: float, options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        Autoscaler().decide(0, value, 1, **{**BOUNDS, **options}, last_scale_time=None)


# ------------------------------------------------------------------------------------------------ the query


def test_the_default_query_selects_the_deployment_and_tolerates_a_missing_namespace_label() -> None:
    q = default_query("llm-a", "prod")
    for metric in ("shardwise_queue_depth", "shardwise_running_requests", "shardwise_kv_cache_usage_ratio"):
        assert f'{metric}{{deployment="llm-a",namespace=~"prod|"}}' in q


def test_the_default_query_never_turns_missing_series_into_zero() -> None:
    q = default_query("llm", "prod")
    assert "vector(0)" not in q and q.count("sum(") == 3


def test_the_default_query_is_balanced_promql() -> None:
    q = default_query("llm", "prod")
    assert q.count("(") == q.count(")") and q.count("{") == q.count("}") and q.count('"') % 2 == 0
    assert q.startswith("max(")


def test_the_kv_term_is_scaled_so_that_kv_usage_at_the_target_ratio_is_one_group() -> None:
    assert re.search(r"sum\(shardwise_kv_cache_usage_ratio\{[^}]*\}\) \* 10\b",
                     default_query("llm", "prod", target_per_dpa=8, kv_target=0.8))


def test_an_empty_namespace_selects_on_the_deployment_only() -> None:
    assert "namespace" not in default_query("llm", "")


@pytest.mark.parametrize("namespace", ["Prod", "a|b", 'x"y', "-a"])
def test_a_namespace_that_kubernetes_cannot_have_is_refused(namespace: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        default_query("llm", namespace)


def test_a_quote_in_the_deployment_name_cannot_break_out_of_the_selector() -> None:
    assert 'deployment="a\\"b"' in default_query('a"b', "")


def test_the_users_query_wins_over_the_default_scoped_to_the_deployment() -> None:
    assert load_query(AutoscalingSpec(query="sum(my_load)"), "llm", "prod") == \
        'sum(my_load{deployment="llm",namespace=~"prod|"})'


def test_a_users_query_that_cannot_be_scoped_is_a_prometheus_error_naming_the_field() -> None:
    with pytest.raises(PrometheusError, match=r"spec.autoscaling.query: the matcher on 'deployment'"):
        load_query(AutoscalingSpec(query='sum(my_load{deployment="other"})'), "llm", "prod")


def test_without_a_users_query_the_default_uses_the_deployments_target() -> None:
    spec = AutoscalingSpec.model_validate({"targetPerDpa": 4})
    assert load_query(spec, "llm", "prod") == default_query("llm", "prod", target_per_dpa=4)


# ------------------------------------------------------------------------------- reading Prometheus over HTTP


class FakePrometheus:
    """An HTTP server answering /api/v1/query with a canned (status, body); records the queries it received."""

    def __init__(self) -> None:
        self.answer: tuple[int, bytes] = (200, b"{}")
        self.queries: list[str] = []
        self.release = threading.Event()
        self.stall = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parsed = urlparse(self.path)
                fake.queries.extend(parse_qs(parsed.query).get("query", []))
                if fake.stall:
                    fake.release.wait(10)
                api = parsed.path.endswith("/api/v1/query")  # also below a path prefix (a proxied Prometheus)
                status, body = fake.answer if api else (404, b"404 page not found")
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a client that timed out left
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), daemon=True)
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def reply(self, status: int, body: Any) -> None:
        self.answer = (status, body if isinstance(body, bytes) else json.dumps(body).encode())


@pytest.fixture
def prom() -> Iterator[FakePrometheus]:
    fake = FakePrometheus()
    fake.thread.start()
    yield fake
    fake.release.set()
    fake.server.shutdown()
    fake.server.server_close()
    fake.thread.join(5)


def sample(value: str, **labels: str) -> dict[str, Any]:
    return {"metric": labels, "value": [1700000000.0, value]}


def ok(kind: str, result: Any) -> dict[str, Any]:
    return {"status": "success", "data": {"resultType": kind, "result": result}}


VALUES = {
    "a vector answers the sum of its samples": (ok("vector", [sample("3", pod="0"), sample("4.5", pod="1")]), 7.5),
    "a vector of zeros is no load": (ok("vector", [sample("0", pod="0")]), 0.0),
    "a scalar answers itself": (ok("scalar", [1700000000.0, "12"]), 12.0),
}


@pytest.mark.parametrize(("body", "expected"), VALUES.values(), ids=VALUES.keys())
def test_a_load_is_read_from_the_answer(prom: FakePrometheus, body: Any, expected: float) -> None:
    prom.reply(200, body)
    assert query_prometheus(prom.url, "sum(x)") == expected


def test_the_query_reaches_prometheus_intact_even_with_a_trailing_slash_in_the_url(prom: FakePrometheus) -> None:
    prom.reply(200, ok("vector", [sample("1")]))
    q = default_query("llm", "prod")
    query_prometheus(prom.url + "/", q)
    assert prom.queries == [q]


ERRORS = {
    "a status error carries Prometheus' errorType and error": (
        200, {"status": "error", "errorType": "execution", "error": "query timed out"},
        r"rejected .*execution: query timed out"),
    "a 400 names the parse error Prometheus gave": (
        400, {"status": "error", "errorType": "bad_data", "error": "1:5: parse error: unclosed left parenthesis"},
        r"HTTP 400 .*bad_data: 1:5: parse error: unclosed left parenthesis"),
    "an HTTP 500 is reported with its code, not its body": (500, b"internal secret\nwith a second line",
                                                            r"HTTP 500 .*not the Prometheus API's error JSON$"),
    "a body that is not JSON is not taken for a load nor repeated": (200, b"<html>secret</html>",
                                                                    r"did not answer as the Prometheus.*19 bytes"),
    "no series is an unknown load, not zero": (200, ok("vector", []), r"returned no series: the load is unknown"),
    "a NaN load is refused": (200, ok("vector", [sample("NaN")]), r"gave nan"),
    "an infinite load is refused": (200, ok("scalar", [0, "+Inf"]), r"gave inf"),
    "a range vector is not a load": (200, ok("matrix", []), r"returned a matrix"),
    "a string is not a load": (200, ok("string", [0, "hi"]), r"returned a string"),
    "a sample without a value is malformed": (200, ok("vector", [{"metric": {}}]), r"malformed result"),
}


@pytest.mark.parametrize(("status", "body", "message"), ERRORS.values(), ids=ERRORS.keys())
def test_a_bad_answer_raises_a_one_line_prometheus_error(prom: FakePrometheus, status: int, body: Any,
                                                         message: str) -> None:
    prom.reply(status, body)
    with pytest.raises(PrometheusError, match=message) as caught:
        query_prometheus(prom.url, "sum(x)")
    assert "\n" not in str(caught.value) and "secret" not in str(caught.value)


@pytest.mark.parametrize("url", ["file:///etc/passwd", "gopher://prometheus:70", "prometheus:9090/x"])
def test_only_an_http_prometheus_is_asked(url: str) -> None:
    with pytest.raises(PrometheusError, match=r"must be an http:// or https:// URL") as caught:
        query_prometheus(url, "sum(x)")
    assert "passwd" not in str(caught.value) and "root" not in str(caught.value)
    with pytest.raises(ValueError, match="prometheusUrl"):
        AutoscalingSpec.model_validate({"prometheusUrl": url})


def test_a_prometheus_outside_the_admins_allowlist_is_refused_without_a_request(prom: FakePrometheus) -> None:
    prom.reply(200, ok("vector", [sample("1")]))
    allowed = ("http://prometheus.monitoring:9090", prom.url + "/tenant-a")
    for url in (prom.url, prom.url + "/tenant-b", prom.url.replace("127.0.0.1", "127.0.0.1.nip.io"),
                "http://prometheus.monitoring:9091", "http://prometheus.monitoring.evil.example:9090",
                "http://user@prometheus.monitoring:9090"):
        with pytest.raises(PrometheusError, match=r"is not one of the Prometheus servers .* it was not contacted"):
            query_prometheus(url, "sum(x)", allowed=allowed)
    assert prom.queries == []  # none of them was asked
    assert query_prometheus(prom.url + "/tenant-a/", "sum(x)", allowed=allowed) == 1.0  # a path below one allowed
    assert prom.queries == ["sum(x)"]


def test_a_prometheus_that_is_not_listening_is_reported_as_unreachable() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(PrometheusError, match=rf"cannot reach Prometheus at http://127.0.0.1:{port}: .*refused"):
            query_prometheus(f"http://127.0.0.1:{port}", "sum(x)")


def test_a_prometheus_that_does_not_answer_in_time_is_reported(prom: FakePrometheus) -> None:
    prom.stall = True
    with pytest.raises(PrometheusError, match=r"cannot reach Prometheus .*timed out"):
        query_prometheus(prom.url, "sum(x)", timeout=0.2)
