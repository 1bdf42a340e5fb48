"""The autoscaler reads a deployment's load from a real Prometheus scraping the agents' metric names, follows it as
it changes, and asks for more attention groups when the KV caches fill up."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from shardwise.controllers.autoscaler import (
    Autoscaler,
    PrometheusError,
    default_query,
    load_query,
    query_prometheus,
)
from shardwise.devcluster.prometheus import PrometheusMissing, PrometheusServer, find_binary

from shardwise.api import AutoscalingSpec

try:
    find_binary()
    MISSING = ""
except PrometheusMissing as e:
    MISSING = str(e)

pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(MISSING), reason=MISSING)]

TARGET = 8.0


class Pods:
    """The agents' gauges (deployment, pod, dpa_group labels) on one local metrics port, as a node agent has them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        labels = ["deployment", "pod", "dpa_group"]
        self.queue = Gauge("shardwise_queue_depth", "Requests waiting for admission.", labels, registry=self.registry)
        self.running = Gauge("shardwise_running_requests", "Requests being decoded.", labels, registry=self.registry)
        self.kv = Gauge("shardwise_kv_cache_usage_ratio", "Fraction of the KV cache in use.", labels,
                        registry=self.registry)
        self.server, self.thread = start_http_server(0, addr="127.0.0.1", registry=self.registry)
        self.target = f"127.0.0.1:{self.server.server_port}"

    def set(self, deployment: str, groups: dict[tuple[int, int], tuple[int, int, float]]) -> None:
        """groups: (pod, dpa_group) -> (queue depth, running requests, KV usage ratio)."""
        for (pod, group), (queue, running, kv) in groups.items():
            labels = (deployment, str(pod), str(group))
            self.queue.labels(*labels).set(queue)
            self.running.labels(*labels).set(running)
            self.kv.labels(*labels).set(kv)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def pods() -> Iterator[Callable[[], Pods]]:
    started: list[Pods] = []

    def start() -> Pods:
        started.append(Pods())
        return started[-1]

    yield start
    for p in started:
        p.stop()


def wait_for_load(url: str, query: str, expected: float, timeout: float = 15) -> float:
    """Poll the query until it answers `expected` (scrapes run every second), with a deadline."""
    deadline = time.monotonic() + timeout
    seen: float | str = "nothing"
    while time.monotonic() < deadline:
        try:
            seen = query_prometheus(url, query)
        except PrometheusError as e:
            seen = str(e)
        if seen == pytest.approx(expected):
            return float(seen)
        time.sleep(0.2)  # polling the condition, with a deadline
    raise AssertionError(f"the load never became {expected} within {timeout:g} s; last answer: {seen}")


def test_the_default_query_follows_the_agents_metrics_and_drives_a_scale_up(
        tmp_path: Path, pods: Callable[[], Pods]) -> None:
    ours, other = pods(), pods()
    # two pods leading two DPA groups each; requests: 3+1+0+2 queued, 4 running each -> 22; KV: 0.4 groups in use
    ours.set("llm", {(0, 0): (3, 4, 0.1), (0, 1): (1, 4, 0.1), (1, 2): (0, 4, 0.1), (1, 3): (2, 4, 0.1)})
    # a deployment of the same name in another namespace: never counted
    other.set("llm", {(0, 0): (100, 100, 1.0)})
    query = default_query("llm", "prod", target_per_dpa=TARGET)
    with PrometheusServer(tmp_path / "prom") as prom:
        prom.set_targets([ours.target, other.target],
                         labels={ours.target: {"namespace": "prod"}, other.target: {"namespace": "staging"}})
        load = wait_for_load(prom.url, query, 22.0)

        scaler, now = Autoscaler(), 1000.0
        bounds = {"target_per_dpa": TARGET, "min_dpa": 1, "max_dpa": 8, "stabilization_s": 60, "cooldown_s": 30}
        first = scaler.decide(now, load, 3, **bounds, last_scale_time=None)
        assert (first.action, first.desired) == ("hold", 3), first.reason  # ceil(22 / 8) = 3 groups already run

        # the same requests, but long contexts fill the KV caches: 3.8 groups' worth of KV at a target of 0.8
        ours.set("llm", {(0, 0): (3, 4, 0.95), (0, 1): (1, 4, 0.95), (1, 2): (0, 4, 0.95), (1, 3): (2, 4, 0.95)})
        load = wait_for_load(prom.url, query, 38.0)

    second = scaler.decide(now + 15, load, 3, **bounds, last_scale_time=None)
    assert (second.action, second.desired) == ("up", 5), second.reason
    assert "load 38 / target 8 per group = 4.75 -> raw 5" in second.reason


def test_a_deployment_without_series_has_an_unknown_load_not_zero(tmp_path: Path) -> None:
    """A real Prometheus with no series of the deployment (never scraped, or gone): the autoscaler must hold, as
    the HPA does with a metric it cannot get, rather than scale a busy deployment down to minDpa."""
    with PrometheusServer(tmp_path / "prom") as prom, pytest.raises(PrometheusError, match="no series"):
        query_prometheus(prom.url, default_query("nothing-here", "prod"))


def test_a_users_query_reads_only_its_own_deployments_series(tmp_path: Path, pods: Callable[[], Pods]) -> None:
    """`spec.autoscaling.query` is a tenant's PromQL: written as `sum(shardwise_running_requests)` it would add up
    every deployment's requests; the autoscaler scopes each selector to the deployment and its namespace."""
    ours, rival, elsewhere = pods(), pods(), pods()
    ours.set("llm", {(0, 0): (0, 3, 0.1), (0, 1): (0, 2, 0.1)})
    rival.set("rival", {(0, 0): (0, 40, 0.9)})  # another deployment in the same namespace
    elsewhere.set("llm", {(0, 0): (0, 500, 0.9)})  # the same name in another namespace
    spec = AutoscalingSpec(query="sum(shardwise_running_requests) + sum(shardwise_queue_depth)")
    with PrometheusServer(tmp_path / "prom") as prom:
        prom.set_targets([ours.target, rival.target, elsewhere.target],
                         labels={ours.target: {"namespace": "prod"}, rival.target: {"namespace": "prod"},
                                 elsewhere.target: {"namespace": "staging"}})
        wait_for_load(prom.url, "sum(shardwise_running_requests)", 545.0)  # every series is scraped
        assert wait_for_load(prom.url, load_query(spec, "llm", "prod"), 5.0) == 5.0
        # a selector with no name at all is scoped too
        assert wait_for_load(prom.url, load_query(AutoscalingSpec(
            query='count({__name__=~"shardwise_running_requests|shardwise_queue_depth"})'), "rival", "prod"),
            2.0) == 2.0


@pytest.mark.parametrize("query", [
    'histogram_quantile(0.95, sum by (le) (rate(shardwise_time_to_first_token_seconds_bucket[5m:30s])))',
    'sum(rate(shardwise_generated_tokens_total{dpa_group!="0",}[1m] offset 1m)) / on() group_left count(up)',
    'max without (pod) (shardwise_queue_depth) > bool 3 or vector(0) * absent(shardwise_queue_depth)',
    'topk(1, label_replace(shardwise_kv_cache_usage_ratio @ end(), "g", "$1", "dpa_group", "(.*)"))',
    'avg_over_time(vllm:num_requests_running[1m]) # a comment with {braces} and "quotes"',
])
def test_scoped_queries_are_promql_that_prometheus_parses(tmp_path: Path, query: str) -> None:
    """The rewriting is checked by Prometheus' own parser: a scoped query must run (an answer, or no series),
    never come back as bad_data."""
    with PrometheusServer(tmp_path / "prom") as prom:
        try:
            query_prometheus(prom.url, load_query(AutoscalingSpec(query=query), "llm", "prod"))
        except PrometheusError as e:
            assert "no series" in str(e), e
