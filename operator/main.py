"""`shardwise operator`: leader election, then the kopf handlers until SIGTERM; health and Prometheus metrics."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import kopf

from . import handlers, webhook
from .handlers import Settings
from .kube import Kube, load_config
from .leader import LeaderElector

log = logging.getLogger("shardwise.operator")
STOP_GRACE_S = 15.0


@dataclass
class OperatorOptions:
    settings: Settings = field(default_factory=Settings)
    namespaces: tuple[str, ...] = ()  # empty: every namespace
    health_port: int = 0  # 0: no liveness endpoint
    metrics_port: int = 0  # 0: no metrics server
    metrics_host: str = "0.0.0.0"
    leader_namespace: str = ""
    leader_name: str = ""  # empty: no leader election (one replica only)
    identity: str = ""


class OperatorCollector:
    """Counters of this operator process, read at scrape time."""

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        yield CounterMetricFamily("shardwise_operator_reconciles", "Reconcile steps run.",
                                  value=handlers.State.reconciles)
        yield CounterMetricFamily("shardwise_operator_reconcile_errors", "Reconcile steps that failed.",
                                  value=handlers.State.errors)
        kube = handlers.State.kube
        yield CounterMetricFamily("shardwise_operator_api_requests", "Kubernetes API requests made.",
                                  value=kube.requests if kube else 0)
        yield CounterMetricFamily("shardwise_operator_api_discovery_requests",
                                  "Of the API requests, those that asked only whether an API is served.",
                                  value=kube.discovery if kube else 0)
        yield GaugeMetricFamily("shardwise_operator_deployments", "Deployments with a running daemon.",
                                value=len(handlers.State.wake))
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "balance": GaugeMetricFamily("shardwise_eplb_balance", "Max/mean GPU expert load, mean over layers.",
                                         labels=["namespace", "deployment"]),
            "rebalances": CounterMetricFamily("shardwise_eplb_rebalances", "Completed expert rebalances.",
                                              labels=["namespace", "deployment"]),
            "failures": CounterMetricFamily("shardwise_eplb_rebalance_failures", "Rebalances that failed.",
                                            labels=["namespace", "deployment"]),
            "slots": CounterMetricFamily("shardwise_eplb_slots_moved", "Expert slots moved by rebalances.",
                                         labels=["namespace", "deployment"]),
            "seconds": GaugeMetricFamily("shardwise_eplb_last_rebalance_seconds", "Duration of the last rebalance.",
                                         labels=["namespace", "deployment"]),
        }
        for (namespace, name), values in list(handlers.State.eplb.items()):
            for key, family in families.items():
                family.add_metric([namespace, name], float(values.get(key, 0.0)))
        yield from families.values()
        ops = handlers.State.reconciler.operations if handlers.State.reconciler else {}
        count = CounterMetricFamily("shardwise_elastic_operations", "Completed scale-ups, scale-downs and recoveries.",
                                    labels=["operation"])
        seconds = CounterMetricFamily("shardwise_elastic_operation_seconds", "Time spent in completed operations.",
                                      labels=["operation"])
        pause = GaugeMetricFamily("shardwise_elastic_last_pause_seconds",
                                  "Stop-the-world pause of the last operation of each kind.", labels=["operation"])
        for operation, (n, total, last) in ops.items():
            count.add_metric([operation], n)
            seconds.add_metric([operation], total)
            pause.add_metric([operation], last)
        yield from (count, seconds, pause)


class Watchdog(logging.Handler):
    """Notices, from kopf's own log, that its watching has died while the process lives on.

    kopf runs each resource's watch as a guarded task: when one fails (every credential refused, an API error it
    cannot retry) kopf logs the error and goes on without it, so the process would keep its Lease and answer its
    health probes while reconciling nothing. A failed guarded task, or an error caused by refused credentials
    (LoginError, 401, 403), makes the operator unhealthy: /healthz answers 503 with the reason, and `run` releases
    the Lease and exits 1, so that Kubernetes restarts the pod and a standby replica may lead."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.failed = threading.Event()
        self.reason = ""

    @staticmethod
    def fatal(record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.name.startswith("kopf"):
            return False
        if record.name.startswith("kopf._cogs.aiokits.aiotasks") and " has failed" in record.getMessage():
            return True  # a guarded, eternal task (a watcher, the authenticator, ...) is gone
        exc = record.exc_info[1] if record.exc_info else None
        while exc is not None:
            if isinstance(exc, kopf.LoginError) or type(exc).__name__ in ("APIUnauthorizedError",
                                                                          "APIForbiddenError"):
                return True
            exc = exc.__cause__ or exc.__context__
        return False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed.is_set() and self.fatal(record):
            self.reason = record.getMessage().splitlines()[0][:300]
            self.failed.set()


def serve_health(port: int, watchdog: Watchdog | None = None) -> Any:
    """/healthz from the start, also while a standby replica waits for the Lease (kopf's own liveness endpoint
    exists only once kopf runs, so a standby would look dead to its probes); 503 once the watchdog saw kopf's
    watching fail."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            found = self.path.split("?")[0] == "/healthz"
            dead = watchdog is not None and watchdog.failed.is_set()
            self.send_response(404 if not found else 503 if dead else 200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            body = "not found" if not found else f"kopf failed: {watchdog.reason}" if watchdog and dead else "ok"
            self.wfile.write(body.encode() + b"\n")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Health)
    threading.Thread(target=server.serve_forever, name="healthz", daemon=True).start()
    return server


def run(o: OperatorOptions) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    conf = handlers.State.settings = dataclasses.replace(o.settings, namespaces=o.namespaces)
    try:  # a configuration that cannot be loaded is said at once (kopf would retry its startup every minute)
        load_config(conf.kubeconfig)
    except Exception as e:
        where = conf.kubeconfig or os.environ.get("KUBECONFIG") or "the pod's service account"
        print(f"operator: cannot load the cluster configuration from {where}: {e}", file=sys.stderr, flush=True)
        return 2
    # this replica's own client (kopf's handlers have theirs): the Lease, and the deployments the webhook reads
    kube = Kube(load_config(conf.kubeconfig)) if conf.webhook_port or o.leader_name else None
    if conf.webhook_port and kube is not None:  # every replica admits, the standbys too: no leadership needed
        api = kube
        handlers.State.webhook = webhook.serve(conf.webhook_host, conf.webhook_port, conf.webhook_cert,
                                               conf.webhook_key, conf.webhook_insecure,
                                               fetch=lambda ns, name: api.get("InferenceDeployment", ns, name))
    if o.settings.kubeconfig:
        os.environ["KUBECONFIG"] = o.settings.kubeconfig  # kopf logs in through the same kubeconfig
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if o.metrics_port:
        from prometheus_client import REGISTRY, start_http_server

        REGISTRY.register(OperatorCollector())
        start_http_server(o.metrics_port, o.metrics_host)
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)  # one INFO line per watch event otherwise
    # the Kubernetes client's pool warns on each of its own retries (three lines per call while the API server is
    # down); the call's failure itself is reported once, as a KubeError
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    watchdog = Watchdog()
    logging.getLogger("kopf").addHandler(watchdog)
    health = serve_health(o.health_port, watchdog) if o.health_port else None
    elector = None
    if o.leader_name:
        identity = o.identity or os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
        assert kube is not None
        elector = LeaderElector(kube, o.leader_namespace or "default", o.leader_name, identity)
        if not elector.acquire(stop, on_wait=lambda m: print(m, flush=True)):
            return 0
        elector.start_renewing()

        def stop_when_lost() -> None:
            elector.lost.wait()
            stop.set()

        threading.Thread(target=stop_when_lost, daemon=True).start()

    def stop_when_dead() -> None:
        watchdog.failed.wait()
        stop.set()

    threading.Thread(target=stop_when_dead, daemon=True).start()
    print("operator: leading" if elector else "operator: running", flush=True)
    # kopf runs in a thread: signals reach this (main) thread, which sets the stop flag and gives kopf
    # STOP_GRACE_S to finish before the process exits regardless (a retrying watch must not keep it alive).
    failure: list[BaseException] = []

    def run_kopf() -> None:
        try:
            kopf.run(standalone=True, clusterwide=not o.namespaces, namespaces=list(o.namespaces), stop_flag=stop)
        except BaseException as e:  # reported by the main thread
            failure.append(e)
        finally:
            stop.set()

    runner = threading.Thread(target=run_kopf, name="kopf", daemon=True)
    runner.start()
    try:
        while not stop.wait(1.0):
            pass
        runner.join(STOP_GRACE_S)
        if runner.is_alive():
            log.warning("kopf did not stop within %.0f s; exiting anyway", STOP_GRACE_S)
    finally:
        if elector is not None:
            elector.release()
        if health is not None:
            health.shutdown()
        if handlers.State.webhook is not None:
            handlers.State.webhook.shutdown()
        if kube is not None:
            kube.close()
    if elector is not None and elector.lost.is_set():
        print("operator: lost the lease; exiting so that only the new leader acts", file=sys.stderr, flush=True)
        return 1
    if failure:
        print(f"operator: kopf failed: {failure[0]!r}", file=sys.stderr, flush=True)
        return 1
    if watchdog.failed.is_set():
        print(f"operator: kopf's watching failed ({watchdog.reason}); exiting so that the pod restarts",
              file=sys.stderr, flush=True)
        return 1
    return 0
