"""The autoscaler: a Prometheus load metric -> the number of attention (DPA) groups a deployment should run.

Glossary. **load**: one number per deployment, read with a PromQL instant query (`spec.autoscaling.query`, or
`default_query`), in requests. **target**: `spec.autoscaling.targetPerDpa`, the load one DPA group should carry.
**recommendation**: `ceil(load / target)`, at least 1, clamped to `[spec.elastic.minDpa, maxDpa]`.

The policy (`Autoscaler.decide`) is the HPA's, per deployment, with no clock or I/O inside:

- **scale up at once** to the newest recommendation: queued requests wait while a decision is stabilised;
- **scale down to the highest recommendation seen within the stabilisation window** (never below it), so a
  dip shorter than the window does not shrink the deployment, and a long lull shrinks it once the window no
  longer holds a higher recommendation;
- **no change within the cooldown** after the last scale (`last_scale_time`), reported as a hold with the
  seconds left: a scale step pauses the world (docs/domain.md section 5), and the metrics need time to settle on
  the new size before they say anything about it.

Worked example (target 8, window 60 s, cooldown 0, 4 groups): load 20 at t=0 -> 3 groups recommended, but a
fresh autoscaler counts the current 4 as seen at t=0, so it holds; load 40 at t=30 -> 5, up at once; load 8
at t=60 -> 1, the window holds 5 -> hold; load 8 at t=91 -> the window [31, 91] holds only 1s -> down to 1.

Hazard: the history of recommendations is the only state that cannot be observed from the cluster. The
caller persists `Autoscaler.persisted()` (the operator: `status.autoscaling.history`, `[[time,
recommendation], ...]`) and rebuilds the autoscaler from it after a restart; `now` and `last_scale_time` must
then come from the same wall clock (`time.time()`). An autoscaler rebuilt with no history (or only expired
entries) takes the current size as its first recommendation, so a restart never triggers an immediate
scale-down.
"""

from __future__ import annotations

import http.client
import json
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Literal

from shardwise.api import RFC1123_LABEL, AutoscalingSpec
from shardwise.promql import PromQLError, scope

#: KV cache usage one group should run at; above it, the default query counts the group as more than loaded.
KV_TARGET_RATIO = 0.8
#: Tolerance of ceil(): 16.000000000000004 requests over a target of 8 are 2 groups, not 3.
_CEIL_EPS = 1e-9

Action = Literal["up", "down", "hold"]


class PrometheusError(Exception):
    """The load could not be read from Prometheus; the message is one line naming the cause."""


#: the series each engine exports for the default query: (waiting, running, KV usage ratio)
ENGINE_SERIES = {
    "reference": ("shardwise_queue_depth", "shardwise_running_requests", "shardwise_kv_cache_usage_ratio"),
    "vllm": ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"),
}


def default_query(deployment: str, namespace: str, *,
                  target_per_dpa: float = AutoscalingSpec().target_per_dpa,
                  kv_target: float = KV_TARGET_RATIO, engine: str = "reference") -> str:
    """The PromQL load of one deployment, in requests: the larger of two signals.

    - **requests**: queue depth plus running requests, summed over every DPA group of every pod;
    - **KV cache**: the groups' KV usage ratios summed (how many groups' worth of KV cache is in use), divided
      by `kv_target` (the usage one group should run at) and times `target_per_dpa`, so that after the
      autoscaler's `ceil(load / target_per_dpa)` it asks for enough groups to bring the usage down to
      `kv_target`. A group at 95 % KV usage with one long request thus counts as 9.5 requests at a target of 8
      (-> 2 groups), where requests alone would say 1: a full KV cache preempts or queues new requests.

    Taking the max (as the HPA does with several metrics) keeps the decision `desired = ceil(load / target)`
    and lets either pressure scale up. A signal whose metrics have no series drops out of the `max`; when both
    have none (no pod scraped yet, a scrape that broke) the query returns nothing, which `query_prometheus`
    reports as an unknown load: the autoscaler holds and says so, never reads it as an idle deployment. Pass the
    deployment's `spec.autoscaling.targetPerDpa` (see `load_query`). With `engine` "vllm" the same signals are
    read from vLLM's own series (`ENGINE_SERIES`), which the agent re-exports with the `deployment` label.

    Selection: the agents label their series `deployment` with the InferenceDeployment's name but do not
    export a namespace; Prometheus' Kubernetes service discovery (or the devcluster's) adds a `namespace`
    target label. The query matches `namespace=~"<namespace>|"`: series of that namespace, or series without
    a namespace label (a scrape config that does not add it), while series of a same-named deployment in
    another namespace are left out. An empty `namespace` matches on the deployment name only.
    """
    if not deployment:
        raise ValueError("default_query needs a deployment name")
    if namespace and not RFC1123_LABEL.match(namespace):
        raise ValueError(f"namespace {namespace!r} is not a Kubernetes namespace name (RFC 1123 label)")
    if target_per_dpa <= 0 or not 0 < kv_target <= 1:
        raise ValueError(f"need target_per_dpa > 0 and 0 < kv_target <= 1, got {target_per_dpa}, {kv_target}")
    name = deployment.replace("\\", "\\\\").replace('"', '\\"')
    selector = f'deployment="{name}"' + (f',namespace=~"{namespace}|"' if namespace else "")

    if engine not in ENGINE_SERIES:
        raise ValueError(f"unknown engine {engine!r}: {', '.join(ENGINE_SERIES)}")
    waiting, running, usage = ENGINE_SERIES[engine]

    def total(metric: str) -> str:
        return f"sum({metric}{{{selector}}})"

    requests = f"{total(waiting)} + {total(running)}"
    kv = f"{total(usage)} * {target_per_dpa / kv_target:.12g}"
    return (f'max(label_replace({requests}, "signal", "requests", "", "") or '
            f'label_replace({kv}, "signal", "kv_cache", "", ""))')


def load_query(autoscaling: AutoscalingSpec, deployment: str, namespace: str, engine: str = "reference") -> str:
    """The query the autoscaler runs for a deployment: the user's `spec.autoscaling.query` with every selector
    scoped to the deployment's own series (`shardwise.promql.scope`), else the default for its engine.
    PrometheusError for a query that cannot be scoped (admission refuses those first)."""
    if autoscaling.query:
        try:
            return scope(autoscaling.query, deployment, namespace)
        except PromQLError as e:
            raise PrometheusError(f"spec.autoscaling.query: {e}") from e
    return default_query(deployment, namespace, target_per_dpa=autoscaling.target_per_dpa, engine=engine)


def _one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + "..."


def _number(raw: Any, query: str) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError) as e:
        raise PrometheusError(f"Prometheus answered a sample that is not a number ({_one_line(repr(raw))}) "
                              f"for {_one_line(query)}") from e
    if not math.isfinite(value):
        raise PrometheusError(f"query {_one_line(query)} gave {value}; the load must be a finite number")
    return value


def allowed_url(url: str, allowed: tuple[str, ...]) -> bool:
    """Whether `url` is one of the Prometheus servers the cluster admin allows: the same scheme, host and port as
    an allowed URL and a path under its path (no allowlist: every http(s) URL). `http://prom` does not admit
    `http://prom.evil.example` nor `http://prom:9091`."""
    if not allowed:
        return True
    u = urllib.parse.urlsplit(url)
    for a in allowed:
        v = urllib.parse.urlsplit(a)
        try:
            same = (u.scheme, u.hostname, u.port) == (v.scheme, v.hostname, v.port)
        except ValueError:  # a port that is not a number
            return False
        if same and (u.path.rstrip("/") + "/").startswith(v.path.rstrip("/") + "/") and not u.username:
            return True
    return False


def query_prometheus(url: str, query: str, timeout: float = 10, allowed: tuple[str, ...] = ()) -> float:
    """Run an instant query on the Prometheus HTTP API at `url` and return its value.

    A vector answers the sum of its samples; a scalar answers itself. Anything else raises `PrometheusError`:
    a URL that is not http(s), an unreachable server, an HTTP error, `status: error` (with Prometheus' errorType
    and error), a body that is not the API's JSON, an empty vector (no series: the load is unknown, not zero),
    a matrix or string result, or a NaN/Inf value (a division by zero in the query: scaling on it would be
    arbitrary). No part of an answer that is not the Prometheus API's is repeated in the message: the URL is
    the tenant's, and what it serves is not theirs to read through the operator's status and events. With
    `allowed` (the operator's --prometheus-allow), a URL outside it is refused before any request.
    """
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in ("http", "https"):
        raise PrometheusError(f"spec.autoscaling.prometheusUrl must be an http:// or https:// URL, got a "
                              f"{scheme or 'relative'} URL")
    if not allowed_url(url, allowed):
        raise PrometheusError(f"spec.autoscaling.prometheusUrl {_one_line(url, 120)} is not one of the Prometheus "
                              f"servers this operator may query ({', '.join(allowed)}); it was not contacted")
    endpoint = url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        with urllib.request.urlopen(endpoint, timeout=timeout) as r:
            raw = r.read()
    except urllib.error.HTTPError as e:
        detail = "not the Prometheus API's error JSON"
        try:
            body = json.loads(e.read(1 << 16))
            detail = f"{body['errorType']}: {_one_line(str(body['error']))}"
        except (ValueError, KeyError, TypeError, OSError):
            pass
        raise PrometheusError(f"Prometheus at {url} answered HTTP {e.code} to {_one_line(query)}: {detail}") from e
    except http.client.HTTPException as e:
        raise PrometheusError(f"{url} did not answer as an HTTP server: {_one_line(repr(e))}") from e
    except (urllib.error.URLError, OSError) as e:
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        raise PrometheusError(f"cannot reach Prometheus at {url}: {_one_line(str(reason))}") from e
    try:
        body = json.loads(raw)
        status = body["status"]
    except (ValueError, KeyError, TypeError) as e:
        raise PrometheusError(f"{url} did not answer as the Prometheus HTTP API ({len(raw)} bytes that are not "
                              f"its JSON)") from e
    if status != "success":
        raise PrometheusError(f"Prometheus rejected {_one_line(query)}: {body.get('errorType', 'error')}: "
                              f"{_one_line(str(body.get('error', 'no message')))}")
    try:
        kind, result = body["data"]["resultType"], body["data"]["result"]
        if kind == "vector":
            if not result:
                raise PrometheusError(f"query {_one_line(query)} returned no series: the load is unknown (metrics "
                                      f"not scraped yet, or gone), so dpa is kept")
            return _number(sum(_number(sample["value"][1], query) for sample in result), query)
        if kind == "scalar":
            return _number(result[1], query)
    except (KeyError, IndexError, TypeError) as e:
        raise PrometheusError(f"Prometheus answered a malformed result for {_one_line(query)} (a {kind} whose "
                              f"samples are not [time, value] pairs)") from e
    raise PrometheusError(f"query {_one_line(query)} returned a {kind}; the autoscaler needs an instant "
                          f"vector or a scalar (a range selector [..] or a string does not give one load)")


@dataclass(frozen=True)
class Decision:
    """One pass of the autoscaler: the size to run (`desired`), how it differs from now, and why."""

    desired: int
    action: Action
    reason: str
    value: float
    recommendation: int  # the newest recommendation, clamped to [minDpa, maxDpa]


@dataclass
class Autoscaler:
    """The scaling policy of one deployment with its history of `(time, recommendation)`, oldest first."""

    history: list[tuple[float, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Accepts what a caller persisted as JSON (lists), in any order.
        self.history = sorted((float(t), int(r)) for t, r in self.history)

    def persisted(self) -> list[list[float | int]]:
        """The history to persist (as JSON): only the entries a later decision can still read. The decisions
        read the highest recommendation since some time, so an entry followed by one at least as high is never
        that highest and is dropped; what is left falls in value with time, at most one entry per size."""
        kept: list[tuple[float, int]] = []
        for t, r in reversed(self.history):
            if not kept or r > kept[-1][1]:
                kept.append((t, r))
        return [[round(t, 3), r] for t, r in reversed(kept)]

    def decide(self, now: float, value: float, current: int, *, target_per_dpa: float, min_dpa: int,
               max_dpa: int, stabilization_s: float, cooldown_s: float,
               last_scale_time: float | None) -> Decision:
        """The size to run now, given the measured load `value` and the `current` number of groups.

        Records the recommendation in `history` and drops entries older than `stabilization_s` (or later than
        `now`: a clock set back). Raises ValueError on arguments no spec can produce.
        """
        if not math.isfinite(value):
            raise ValueError(f"the load must be a finite number, got {value}")
        if target_per_dpa <= 0 or not 1 <= min_dpa <= max_dpa or current < 0:
            raise ValueError(f"need target_per_dpa > 0, 1 <= min_dpa <= max_dpa and current >= 0; got "
                             f"target {target_per_dpa}, min {min_dpa}, max {max_dpa}, current {current}")
        if stabilization_s < 0 or cooldown_s < 0:
            raise ValueError(f"need non-negative window and cooldown, got {stabilization_s}, {cooldown_s}")

        ratio = value / target_per_dpa
        raw = max(1, math.ceil(ratio - _CEIL_EPS))
        recommendation = min(max(raw, min_dpa), max_dpa)
        if raw > max_dpa:
            bounds = f"clamped to maxDpa {max_dpa}"
        elif raw < min_dpa:
            bounds = f"raised to minDpa {min_dpa}"
        else:
            bounds = f"within [{min_dpa}, {max_dpa}]"
        parts = [f"load {value:g} / target {target_per_dpa:g} per group = {ratio:.3g} -> raw {raw}, {bounds}"]

        self.history = [(t, r) for t, r in self.history if now - stabilization_s <= t <= now]
        if not self.history and stabilization_s > 0:
            seed = min(max(current, min_dpa), max_dpa)
            self.history.append((now, seed))
            parts.append(f"no history yet: the current {seed} counts as recommended now")
        self.history.append((now, recommendation))
        highest = max(r for _, r in self.history)
        parts.append(f"highest over the {stabilization_s:g} s window: {highest} ({len(self.history)} samples)")

        action: Action
        if recommendation > current:
            desired, action = recommendation, "up"
            outcome = f"scale up {current} -> {desired} at once"
        elif highest < current:
            desired, action = highest, "down"
            outcome = f"scale down {current} -> {desired}"
        elif recommendation < current:
            desired, action = current, "hold"
            outcome = f"hold at {current}: a scale-down waits until the window holds no higher recommendation"
        else:
            desired, action = current, "hold"
            outcome = f"hold at {current}: already at the recommendation"

        if last_scale_time is not None and now - last_scale_time < cooldown_s:
            left = last_scale_time + cooldown_s - now
            would = f" (would scale {action} to {desired})" if action != "hold" else ""
            outcome = f"hold at {current}: cooldown, {left:.0f} s left of {cooldown_s:g} s after the last scale{would}"
            desired, action = current, "hold"
        parts.append(outcome)
        return Decision(desired, action, "; ".join(parts), value, recommendation)
