"""Latency histograms in seconds: a pod's requests, kept where the tokens arrive (the rank pool), and the
router's answers per group (`Histogram` alone; no torch here, so the router can import it).

- **TTFT**, time to first token: from the pool queueing a request on its DPA group to the first generated token
  reaching the pool (queueing and prefill included; HTTP parsing and tokenizing before it are not).
- **TPOT**, time per output token: the gap between two consecutive tokens of one request, one observation each.

Buckets are fixed (Prometheus histograms are aggregated across pods by bucket, so every pod must use the same).
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


@dataclass
class Histogram:
    """Counts per bucket upper bound (plus +Inf), their sum and count; safe to observe and read from threads."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, seconds: float) -> None:
        with self.lock:
            self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
            self.total += seconds

    def cumulative(self) -> tuple[list[tuple[str, float]], float]:
        """(bucket bound as Prometheus writes it, requests at or under it) with +Inf last, and the sum."""
        with self.lock:
            counts, total = list(self.counts), self.total
        out, running = [], 0
        for bound, n in zip((*(f"{b:g}" for b in self.bounds), "+Inf"), counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out, total


@dataclass
class GroupLatency:
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(TPOT_BUCKETS))
