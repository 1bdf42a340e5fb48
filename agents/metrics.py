"""Prometheus metrics of a pod (`/metrics`, port 9090), read from the agent's latest snapshot so a scrape
never waits on the ranks. Names follow Prometheus conventions: `shardwise_` prefix, base units (seconds),
`_total` for counters, rates left to PromQL (`rate(shardwise_generated_tokens_total[1m])`).

Labels: `deployment` (the InferenceDeployment), `pod_index` (the pod's index in its world: not `pod`, which
Prometheus' Kubernetes discovery sets to the pod's name), `dpa_group`.

Expert load is bounded by default: one series per pod, `shardwise_expert_balance_ratio`, the busiest EP rank's
share of routed tokens over the mean (1.0 is perfect balance), in the pod's worst MoE layer, over the sliding
window. With `--expert-metrics per-expert` (SHARDWISE_EXPERT_METRICS) each logical expert of each layer gets
`shardwise_expert_load_tokens{layer,expert}` too: 14,848 series per pod for DeepSeek-V3 (58 MoE layers x 256).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from shardwise.agents.agent import Agent
    from shardwise.agents.proto import agent_pb2 as pb

def balance_ratio(load: pb.ExpertLoad, ep: int) -> float | None:
    """The busiest EP rank's routed tokens over the mean, worst layer first; a token for an expert with several
    replicas counts evenly on each. None without MoE layers or routed tokens."""
    worst: float | None = None
    for layer in load.layers:
        phy = np.asarray(layer.phy2log, dtype=np.int64)
        tokens = np.asarray(layer.tokens_per_logical_expert, dtype=np.float64)
        if not len(phy) or len(phy) % ep or tokens.sum() <= 0:
            continue
        copies = np.bincount(phy, minlength=len(tokens))
        per_slot = tokens[phy] / copies[phy]
        per_rank = per_slot.reshape(ep, -1).sum(axis=1)
        ratio = float(per_rank.max() / per_rank.mean())
        worst = ratio if worst is None else max(worst, ratio)
    return worst


class AgentCollector(Collector):
    def __init__(self, agent: Agent, expert_metrics: str = "aggregate") -> None:
        self.agent = agent
        self.per_expert = expert_metrics == "per-expert"

    def collect(self) -> Iterator[Metric]:
        a = self.agent
        stats = a.stats()
        labels = ["deployment", "pod_index"]
        base = [a.config.deployment, str(a.config.pod_index)]
        gauges: dict[str, tuple[str, Callable[[pb.DpaGroupStats], float]]] = {
            "queue_depth": ("Requests waiting for admission.", lambda g: g.queue_depth),
            "running_requests": ("Requests being decoded.", lambda g: g.running_requests),
            "kv_cache_usage_ratio": ("Fraction of the KV cache in use.", lambda g: g.kv_cache_usage),
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
        yield from self._latency(labels, base)
        done = CounterMetricFamily("shardwise_requests", "Requests finished, by finish reason.",
                                   labels=[*labels, "finish_reason"])
        for reason, n in sorted((a.pool.finished if a.pool else {}).items()):
            done.add_metric([*base, reason], float(n))
        yield done
        yield from self._experts(labels, base)
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

    def _latency(self, labels: list[str], base: list[str]) -> Iterator[Metric]:
        pool = self.agent.pool
        kinds = (("time_to_first_token_seconds", "Time from a request's queueing on its DPA group to its first "
                  "token.", "ttft"), ("time_per_output_token_seconds", "Time between two consecutive tokens of a "
                  "request.", "tpot"))
        for name, doc, which in kinds:
            h = HistogramMetricFamily(f"shardwise_{name}", doc, labels=[*labels, "dpa_group"])
            for group, latency in sorted((pool.latency if pool else {}).items()):
                buckets, total = getattr(latency, which).cumulative()
                h.add_metric([*base, str(group)], buckets, total)
            yield h

    def _experts(self, labels: list[str], base: list[str]) -> Iterator[Metric]:
        a = self.agent
        if a.pool is None or not a.snapshot.stats:
            return
        load = a.expert_load(a.snapshot.stats)  # the latest snapshot: a scrape never waits on the ranks
        ratio = balance_ratio(load, a.pool.spec.grid.ep)
        g = GaugeMetricFamily("shardwise_expert_balance_ratio", "Busiest EP rank's routed tokens over the mean "
                              "(1 = balanced), worst MoE layer, over the sliding window.", labels=labels)
        if ratio is not None:
            g.add_metric(base, ratio)
        yield g
        if self.per_expert:
            m = GaugeMetricFamily("shardwise_expert_load_tokens",
                                  "Tokens routed to each logical expert over the sliding window.",
                                  labels=[*labels, "layer", "expert"])
            for layer in load.layers:
                for e, n in enumerate(layer.tokens_per_logical_expert):
                    m.add_metric([*base, str(layer.layer), str(e)], float(n))
            yield m


def serve(agent: Agent, host: str, port: int, expert_metrics: str = "aggregate") -> tuple[object, int]:
    """Start the metrics server; returns (server, bound port)."""
    registry = CollectorRegistry()
    registry.register(AgentCollector(agent, expert_metrics))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, server.server_port
