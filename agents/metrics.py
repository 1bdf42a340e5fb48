"""Prometheus metrics of a pod (`/metrics`, port 9090), read from the agent's latest snapshot so a scrape
never waits on the ranks. Names follow Prometheus conventions: `shardwise_` prefix, base units, `_total`
for counters."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from shardwise.agents.agent import Agent
    from shardwise.agents.proto import agent_pb2 as pb


class AgentCollector(Collector):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        a = self.agent
        stats = a.stats()
        labels = ["deployment", "pod"]
        base = [a.config.deployment, str(a.config.pod_index)]
        gauges: dict[str, tuple[str, Callable[[pb.DpaGroupStats], float]]] = {
            "queue_depth": ("Requests waiting for admission.", lambda g: g.queue_depth),
            "running_requests": ("Requests being decoded.", lambda g: g.running_requests),
            "kv_cache_usage_ratio": ("Fraction of the KV cache in use.", lambda g: g.kv_cache_usage),
            "tokens_per_second": ("Generation rate over the last poll interval.", lambda g: g.tokens_per_second),
        }
        for name, (doc, get) in gauges.items():
            m = GaugeMetricFamily(f"shardwise_{name}", doc, labels=[*labels, "dpa_group"])
            for group in stats.groups:
                m.add_metric([*base, str(group.dpa_group)], float(get(group)))
            yield m
        c = CounterMetricFamily("shardwise_generated_tokens", "Tokens generated.", labels=[*labels, "dpa_group"])
        for group in stats.groups:
            c.add_metric([*base, str(group.dpa_group)], float(group.generated_tokens_total))
        yield c
        done = CounterMetricFamily("shardwise_requests", "Requests finished, by finish reason.",
                                   labels=[*labels, "finish_reason"])
        for reason, n in sorted((a.pool.finished if a.pool else {}).items()):
            done.add_metric([*base, reason], float(n))
        yield done
        load = GaugeMetricFamily("shardwise_expert_load_tokens",
                                 "Tokens routed to each logical expert over the sliding window.",
                                 labels=[*labels, "layer", "expert"])
        for s in a.snapshot.stats:
            if a.pool is not None and s["rank"] == min(a.pool.local):
                for layer, counts in s["expertLoad"].items():
                    for e, n in enumerate(counts):
                        load.add_metric([*base, str(layer), str(e)], float(n))
        yield load
        g = GaugeMetricFamily("shardwise_world_generation", "Active world generation.", labels=labels)
        g.add_metric(base, float(a.active))
        yield g
        g = GaugeMetricFamily("shardwise_expert_map_generation", "Expert map generation in force.", labels=labels)
        g.add_metric(base, float(a.map_generation))
        yield g
        g = GaugeMetricFamily("shardwise_pause_seconds", "Length of the last pause (stop-the-world).", labels=labels)
        g.add_metric(base, float(stats.last_pause_seconds))
        yield g
        c = CounterMetricFamily("shardwise_rank_crashes", "Rank processes that exited unexpectedly.", labels=labels)
        c.add_metric(base, float(a.crashes_total))
        yield c


def serve(agent: Agent, host: str, port: int) -> tuple[object, int]:
    """Start the metrics server; returns (server, bound port)."""
    registry = CollectorRegistry()
    registry.register(AgentCollector(agent))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port
