"""kopf handlers of the operator. `shardwise operator` runs them (with leader election, health and metrics);
`kopf run -m shardwise.operator.handlers` runs them too, configured from the environment (see `Settings`).

- `startup`: kopf's settings, the API client and the watch-fed cache the steps read from (operator/cache.py),
  whose changes wake the steps; under `kopf run` with SHARDWISE_WEBHOOK_PORT also the admission webhook
  (operator/webhook.py; `shardwise operator` starts it itself, before leader election).
- `world`: a daemon per InferenceDeployment running reconcile steps (operator/reconcile.py) until the object goes;
  it wakes early on a spec change of its deployment, on any change of its pods and when an object it owns goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import itertools
import logging
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import kopf

from shardwise import envvars
from shardwise.api import GROUP, PLURAL, VERSION

from . import builders as b
from . import webhook
from .cache import CACHED, Cache
from .kube import Kube, KubeError, Obj, bearer_token, load_config
from .reconcile import KIND, ReconcileOptions, Reconciler, spec_errors
from .status import iso_at, now_iso, parse_iso

log = logging.getLogger("shardwise.operator")

CACHE_SYNC_S = 30.0  # how long the start waits for the cache's first lists
STEPS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="reconcile")  # blocking reconcile steps
LOGIN_TTL_S = 300.0  # in a pod, kopf logs in again this often to read the rotated ServiceAccount token
EPLB_CHECK_S = float(os.environ.get("SHARDWISE_EPLB_CHECK_SECONDS", "10"))


@dataclass
class Settings:
    kubeconfig: str | None = None
    namespaces: tuple[str, ...] = ()  # the namespaces watched (empty: every namespace)
    options: ReconcileOptions = field(default_factory=ReconcileOptions)
    webhook_port: int = 0  # 0: no webhook server
    webhook_host: str = "0.0.0.0"
    webhook_cert: str | None = None
    webhook_key: str | None = None
    webhook_insecure: bool = False  # plain HTTP (tests and local development only)

    @classmethod
    def from_env(cls) -> Settings:
        def env(name: str, default: str | None = None) -> Any:  # never a service link's tcp://... value
            return envvars.own(name, default) if default is not None else envvars.own_or_none(name)

        return cls(
            kubeconfig=env("KUBECONFIG"), namespaces=tuple(env("SHARDWISE_WATCH_NAMESPACES", "").split()),
            options=ReconcileOptions(
                build=b.BuildOptions(image=env("SHARDWISE_AGENT_IMAGE", ""),
                                     gang_scheduler=env("SHARDWISE_GANG_SCHEDULER", ""),
                                     endpoint_picker=env("SHARDWISE_ENDPOINT_PICKER", ""),
                                     network_policy_namespace=env("SHARDWISE_NETWORK_POLICY_NAMESPACE", "")),
                gang_timeout_s=float(env("SHARDWISE_GANG_TIMEOUT", "300")),
                prometheus_allow=tuple(env("SHARDWISE_PROMETHEUS_ALLOW", "").split())),
            webhook_port=int(env("SHARDWISE_WEBHOOK_PORT", "0")), webhook_cert=env("SHARDWISE_WEBHOOK_CERT"),
            webhook_key=env("SHARDWISE_WEBHOOK_KEY"))


class State:
    settings: Settings | None = None
    kube: Kube | None = None
    cache: Cache | None = None
    reconciler: Reconciler | None = None
    webhook: Any = None  # the admission webhook's server (`webhook.serve`), started once per process
    wake: ClassVar[dict[tuple[str, str], asyncio.Event]] = {}
    eplb: ClassVar[dict[tuple[str, str], dict[str, float]]] = {}  # per deployment: balance, rebalances, ...
    reconciles = 0
    errors = 0


def _wake(namespace: str, name: str) -> None:
    event = State.wake.get((namespace, name))
    if event is not None:
        event.set()


class Backoffs:
    """kopf's pauses between tries of a failed API request: 1, 1, 2, 3, 5 s, then every 5 s for as long as it
    takes (kopf's default gives up after about 55 s, and the operator would exit)."""

    def __iter__(self) -> Iterator[float]:
        return itertools.chain((1.0, 1.0, 2.0, 3.0, 5.0), itertools.repeat(5.0))


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    conf = State.settings = State.settings or Settings.from_env()
    # Progress in annotations, never in status (the CRD's status schema is ours).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="shardwise.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="shardwise.io", key="last-handled-configuration")
    settings.persistence.finalizer = "shardwise.io/operator"
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.error_backoffs = Backoffs()  # an API server down for minutes is waited out
    State.kube = Kube(load_config(conf.kubeconfig))
    if conf.webhook_port and State.webhook is None:  # `kopf run -m shardwise.operator.handlers`
        kube = State.kube
        State.webhook = webhook.serve(conf.webhook_host, conf.webhook_port, conf.webhook_cert, conf.webhook_key,
                                      conf.webhook_insecure,
                                      fetch=lambda ns, name: kube.get("InferenceDeployment", ns, name))
    State.reconciler = Reconciler(State.kube, conf.options)
    await start_cache(State.kube, conf.namespaces, bool(conf.options.build.network_policy_namespace))


async def start_cache(kube: Kube, namespaces: tuple[str, ...], network_policies: bool) -> None:
    """The cache the steps read from, filled by watches before kopf starts any daemon (it waits for the first
    lists, at most CACHE_SYNC_S: until then reads go to the API); its changes wake the steps they concern."""
    loop = asyncio.get_running_loop()

    def changed(kind: str, old: Obj | None, new: Obj | None) -> None:
        wake = woken_by(kind, old, new)
        if wake is not None:
            loop.call_soon_threadsafe(_wake, *wake)
            if new is None and kind not in ("Pod", KIND):  # an owned object deleted: checked at the next step
                assert State.reconciler is not None
                State.reconciler.forget_ensured(*wake)

    kinds = {k: v for k, v in CACHED.items() if network_policies or k != "NetworkPolicy"}  # made only when enabled
    State.cache = Cache(kube, namespaces, changed, kinds)
    kube.cache = State.cache
    State.cache.start()
    ready = await loop.run_in_executor(None, State.cache.wait_synced, CACHE_SYNC_S)
    if not ready:
        log.warning("the cache has not listed everything within %.0f s; reads go to the API until it has",
                    CACHE_SYNC_S)


def woken_by(kind: str, old: Obj | None, new: Obj | None) -> tuple[str, str] | None:
    """The deployment whose step a cached change wakes: its own new generation or deletion, any change of one of
    its pods, the deletion of an object it owns; None for the rest (its own status writes above all)."""
    obj = new if new is not None else old
    if obj is None:
        return None
    meta = obj["metadata"]
    if kind == KIND:
        before = (old or {}).get("metadata") or {}
        if new is not None and old is not None and (meta.get("generation"), bool(meta.get("deletionTimestamp"))) \
                == (before.get("generation"), bool(before.get("deletionTimestamp"))):
            return None
        return str(meta.get("namespace") or ""), str(meta["name"])
    owner = (meta.get("labels") or {}).get(b.LABEL_DEPLOYMENT)
    if not owner or (kind != "Pod" and new is not None):
        return None
    return str(meta.get("namespace") or ""), str(owner)


@kopf.on.login()
def login(**_: Any) -> kopf.ConnectionInfo:
    """kopf connects as the rest of the operator does: the kubeconfig named by --kubeconfig or in-cluster.

    In a pod the ServiceAccount's token is bound and expires (the kubelet rotates its file): the credentials
    expire here after LOGIN_TTL_S, so kopf logs in again and reads the file anew; a 401 does the same at once."""
    conf = load_config((State.settings or Settings.from_env()).kubeconfig)
    expires = None
    if conf.refresh_api_key_hook is not None:
        expires = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=LOGIN_TTL_S)
    return kopf.ConnectionInfo(
        server=conf.host, ca_path=conf.ssl_ca_cert, insecure=not conf.verify_ssl,
        token=bearer_token(conf), certificate_path=conf.cert_file,
        private_key_path=conf.key_file, expiration=expires)


@kopf.on.cleanup()
def cleanup(**_: Any) -> None:
    if State.cache is not None:
        State.cache.stop()
    if State.reconciler is not None:
        State.reconciler.close()
    if State.kube is not None:
        State.kube.close()


@kopf.daemon(GROUP, VERSION, PLURAL, id="world", cancellation_timeout=10.0)
async def world(stopped: kopf.DaemonStopped, namespace: str | None, name: str, **_: Any) -> None:
    """Reconcile steps (blocking API and agent calls, run on the step pool) until the deployment goes; between
    steps it sleeps for the step's delay or until woken by an event of the deployment or its pods."""
    assert namespace is not None  # InferenceDeployments are namespaced
    key = (namespace, name)
    wake = State.wake.setdefault(key, asyncio.Event())
    loop = asyncio.get_running_loop()
    if State.reconciler is not None and State.reconciler.on_change is None:  # agents' pushed health wakes steps
        def wake_from_thread(ns: str, n: str) -> None:
            loop.call_soon_threadsafe(_wake, ns, n)

        State.reconciler.on_change = wake_from_thread
    try:
        while not stopped:
            assert State.reconciler is not None
            wake.clear()
            try:
                delay = await loop.run_in_executor(STEPS, State.reconciler.step, namespace, name)
                State.reconciles += 1
            except Exception as e:  # a failed step is logged and retried; the daemon must outlive API hiccups
                State.errors += 1
                failed(f"reconcile of {namespace}/{name}", e)
                delay = 5.0
            if delay is None:
                return
            if delay <= 0:  # the next step at once (its awaitables are not made: nothing would await them)
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_first(wake.wait(), stopped.wait()), timeout=delay)
    finally:
        State.wake.pop(key, None)


def failed(what: str, e: Exception) -> None:
    """Log a failed step: one line when the API server is unavailable (an outage says so at each retry, not with a
    traceback each time); the traceback for anything else."""
    if isinstance(e, KubeError) and e.unavailable:
        log.warning("%s failed: %s; retrying", what, e)
    else:
        log.error("%s failed", what, exc_info=e)


async def _first(*aws: Any) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()


def _eplb_enabled(spec: Any, **_: Any) -> bool:
    return bool((spec.get("eplb") or {}).get("enabled"))


@kopf.daemon(GROUP, VERSION, PLURAL, id="eplb", when=_eplb_enabled, cancellation_timeout=10.0)
async def eplb(stopped: kopf.DaemonStopped, namespace: str | None, name: str, **_: Any) -> None:
    """Expert-parallel load balancing while the world serves (controllers/eplb.py); one check per
    EPLB_CHECK_S, a rebalance when the balance passes the threshold or the interval has passed."""
    assert namespace is not None  # InferenceDeployments are namespaced
    loop = asyncio.get_running_loop()
    while not stopped:
        try:
            await loop.run_in_executor(STEPS, eplb_check, namespace, name)
        except Exception as e:
            failed(f"EPLB check of {namespace}/{name}", e)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopped.wait(), timeout=EPLB_CHECK_S)


def eplb_check(namespace: str, name: str) -> None:
    from shardwise.controllers import eplb as ctl

    r, kube = State.reconciler, State.kube
    assert r is not None and kube is not None
    world = r.serving_world(namespace, name)
    if world is None:
        return
    obj, spec, _plan, pods, token = world
    if spec.runtime.engine.value == "vllm":
        return  # vLLM balances its experts itself (--enable-eplb from spec.eplb); nothing to move from here
    status = dict((obj.get("status") or {}).get("eplb") or {})
    if status.get("inProgress"):
        # Experts move only inside a check, and this process runs one check of a deployment at a time: a mark
        # found here was left by a process that died mid-rebalance (or by an earlier leader). It would hold
        # scaling back until its deadline; the agents' maps, observed below, say where the experts are now.
        log.warning("EPLB of %s/%s: clearing the mark of a rebalance an earlier operator process left unfinished",
                    namespace, name)
        # the Event first: whoever sees the mark gone finds why
        r.event(obj, "RebalanceInterrupted", "a rebalance by an earlier operator process did not finish: its mark "
                "is cleared and the experts are balanced from the agents' maps", warning=True)
        _patch_eplb(namespace, name, {"inProgress": None, "inProgressDeadline": None})
    last = parse_iso(status.get("lastRebalanceTime"))
    world_gen = (obj.get("status") or {}).get("worldGeneration")
    new_world = status.get("world") != world_gen
    if new_world:
        last = None  # a new world (scaled or recovered): balance its map from the measured load now
    try:
        obs = ctl.observe(pods, token)
    except Exception as e:  # an agent went away mid-check: the reconciler handles the world
        log.warning("EPLB of %s/%s: observing failed: %s", namespace, name, e)
        return
    par = spec.parallelism
    ep = int((obj.get("status") or {}).get("worldDpa") or par.dpa) * par.tp * par.cp // par.moe_tp
    decision = ctl.decide(obs, spec.eplb, ep=ep, nodes=len(pods),
                          seconds_since_last=None if last is None else time.time() - last)
    State.eplb.setdefault((namespace, name), {})["balance"] = decision.balance_before
    if decision.action != "planned":
        # with load measured, this world is looked at; what was decided for it first stays in worldDecision
        settled: dict[str, Any] = {"world": world_gen} if obs.tokens else {}
        if obs.tokens and new_world:
            settled["worldDecision"] = decision.reason
        _patch_eplb(namespace, name, {"balanceCurrent": round(decision.balance_before, 4),
                                      "mapGeneration": obs.map_generation, "lastCheck": decision.reason, **settled})
        return
    # the mark holds scaling back while experts move; its deadline frees it if this process dies mid-rebalance
    deadline = iso_at(time.time() + spec.elastic.operation_timeout_seconds)
    _patch_eplb(namespace, name, {"inProgress": True, "inProgressDeadline": deadline})
    try:
        outcome = ctl.execute(pods, token, obs, decision)
    except Exception as e:
        _patch_eplb(namespace, name, {"inProgress": None, "inProgressDeadline": None, "lastError": str(e)[:200],
                                      "lastFailureTime": now_iso()})
        raise
    patch: dict[str, Any] = {"inProgress": None, "inProgressDeadline": None, "mapGeneration": outcome.map_generation,
                             "balanceBefore": round(outcome.balance_before, 4),
                             "balanceAfter": round(outcome.balance_after, 4),
                             "durationSeconds": round(outcome.seconds, 3), "lastCheck": outcome.reason}
    if outcome.action == "rebalanced":
        patch.update(lastRebalanceTime=now_iso(), slotsMoved=outcome.slots_moved, bytesMoved=outcome.bytes_moved,
                     world=world_gen,
                     balanceCurrent=round(outcome.balance_after, 4), lastError=None)
        if new_world:
            patch["worldDecision"] = outcome.reason
        r.event(obj, "Rebalanced", f"map generation {outcome.map_generation}: {outcome.reason}, "
                                   f"{outcome.bytes_moved} bytes in {outcome.seconds:.2f} s")
        m = State.eplb[(namespace, name)]
        m.update(balance=outcome.balance_after, rebalances=m.get("rebalances", 0) + 1,
                 slots=m.get("slots", 0) + outcome.slots_moved, seconds=outcome.seconds)
    else:
        patch.update(lastError=outcome.reason, lastFailureTime=now_iso())
        r.event(obj, "RebalanceFailed", outcome.reason, warning=True)
        m = State.eplb[(namespace, name)]
        m["failures"] = m.get("failures", 0) + 1
    _patch_eplb(namespace, name, patch)


def _autoscaling_enabled(spec: Any, **_: Any) -> bool:
    return bool((spec.get("autoscaling") or {}).get("enabled"))


@kopf.daemon(GROUP, VERSION, PLURAL, id="autoscaler", when=_autoscaling_enabled, cancellation_timeout=10.0)
async def autoscaler(stopped: kopf.DaemonStopped, namespace: str | None, name: str, **_: Any) -> None:
    """Sets spec.parallelism.dpa from a Prometheus query every spec.autoscaling.intervalSeconds
    (controllers/autoscaler.py holds the policy; the elastic state machine then scales in place)."""
    assert namespace is not None  # InferenceDeployments are namespaced
    from shardwise.controllers.autoscaler import Autoscaler

    scaler = Autoscaler()
    loop = asyncio.get_running_loop()
    while not stopped:
        interval = 15.0
        try:
            interval = await loop.run_in_executor(STEPS, autoscale_check, scaler, namespace, name)
        except Exception as e:
            failed(f"autoscaling of {namespace}/{name}", e)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopped.wait(), timeout=interval)


def autoscale_check(scaler: Any, namespace: str, name: str) -> float:
    from shardwise.controllers.autoscaler import Autoscaler, PrometheusError, load_query, query_prometheus

    r, kube = State.reconciler, State.kube
    assert r is not None and kube is not None
    obj = kube.get("InferenceDeployment", namespace, name)
    if obj is None or obj["metadata"].get("deletionTimestamp"):
        return 15.0
    spec, _p, errors = spec_errors(obj.get("spec"))
    if spec is None or errors:
        return 15.0
    a, st = spec.autoscaling, obj.get("status") or {}
    mine = dict(st.get("autoscaling") or {})
    if st.get("phase") not in ("Running", "Rebalancing"):
        return float(a.interval_seconds)  # no decision while the world forms, scales or recovers
    try:
        query = load_query(a, name, namespace, spec.runtime.engine.value)
        value = query_prometheus(a.prometheus_url, query, allowed=r.options.prometheus_allow)
    except PrometheusError as e:
        if mine.get("lastError") != str(e):
            r.event(obj, "AutoscalingError", f"{e}; keeping dpa {spec.parallelism.dpa}", warning=True)
        _patch_status(namespace, name, "autoscaling", {"lastError": str(e), "lastCheck": now_iso()})
        return float(a.interval_seconds)
    if not scaler.history and mine.get("history"):  # a restarted operator: the window's recommendations
        scaler.history = Autoscaler(history=mine["history"]).history
    current = spec.parallelism.dpa
    decision = scaler.decide(time.time(), value, current, target_per_dpa=a.target_per_dpa,
                             min_dpa=spec.elastic.min_dpa, max_dpa=spec.elastic.max_dpa,
                             stabilization_s=a.stabilization_window_seconds, cooldown_s=a.cooldown_seconds,
                             last_scale_time=parse_iso(mine.get("lastScaleTime")))
    fields: dict[str, Any] = {"lastValue": round(value, 3), "lastCheck": now_iso(), "desiredDpa": decision.desired,
                              "lastDecision": decision.reason, "lastError": None, "history": scaler.persisted()}
    if decision.action != "hold" and decision.desired != current:
        kube.patch("InferenceDeployment", namespace, name, {"spec": {"parallelism": {"dpa": decision.desired}}})
        fields["lastScaleTime"] = now_iso()
        r.event(obj, "AutoscaleUp" if decision.action == "up" else "AutoscaleDown",
                f"dpa {current} -> {decision.desired}: {decision.reason}")
    elif mine.get("lastDecision", "").split(";")[0] != decision.reason.split(";")[0]:
        r.event(obj, "AutoscaleHold", decision.reason)  # a new kind of hold (e.g. cooldown), not every tick
    _patch_status(namespace, name, "autoscaling", fields)
    return float(a.interval_seconds)


def worth_writing(current: dict[str, Any], fields: dict[str, Any]) -> bool:
    """Whether a daemon's status block changes enough to write: a field other than the time of the check differs,
    or the measured balance moved by 0.01 or more (a check every few seconds that finds the same would otherwise
    write, and wake every watcher of the deployment, each time)."""
    for key, value in fields.items():
        old = current.get(key)
        if key == "lastCheck" and "lastValue" in fields:  # the autoscaler's: a timestamp
            continue
        if key == "balanceCurrent" and isinstance(old, (int, float)) and isinstance(value, (int, float)):
            if abs(old - value) >= 0.01:
                return True
            continue
        if old != value:
            return True
    return False


def _patch_status(namespace: str, name: str, key: str, fields: dict[str, Any]) -> None:
    assert State.kube is not None
    obj = State.kube.get("InferenceDeployment", namespace, name, cached=False)  # (the cache may lag a write)
    if obj is not None and not worth_writing(dict((obj.get("status") or {}).get(key) or {}), fields):
        return
    State.kube.patch("InferenceDeployment", namespace, name, {"status": {key: fields}}, subresource="status")


def _patch_eplb(namespace: str, name: str, fields: dict[str, Any]) -> None:
    _patch_status(namespace, name, "eplb", fields)
