"""Leader election on a coordination.k8s.io Lease, as client-go's leaderelection does it.

One operator replica holds the Lease and acts; the others wait. The holder renews every `renew_s`; a Lease not
renewed for `duration_s` may be taken over. Writes carry the Lease's resourceVersion, so two replicas racing for
it cannot both win (the loser gets 409 and keeps waiting). A holder that has not renewed for `renew_deadline_s`
(less than `duration_s`, as client-go's renew deadline) stops acting (`lost` is set), so it has stopped before
any other replica may take the Lease over; each renewal's API request is bounded by what is left of that deadline.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections.abc import Callable

from .kube import Kube, KubeError, Obj, path

log = logging.getLogger("shardwise.operator.leader")


def _micro(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse(value: str | None) -> float:
    if not value:
        return 0.0
    value = value.replace("Z", "+00:00")
    return dt.datetime.fromisoformat(value).timestamp()


class LeaderElector:
    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, *, duration_s: float = 15.0,
                 renew_s: float = 2.0, renew_deadline_s: float = 10.0, clock: Callable[[], float] = time.time) -> None:
        if not 0 < renew_s < renew_deadline_s < duration_s:
            raise ValueError(f"leader election needs 0 < renew ({renew_s} s) < renew deadline ({renew_deadline_s} s) "
                             f"< lease duration ({duration_s} s)")
        self.kube, self.namespace, self.name, self.identity = kube, namespace, name, identity
        self.duration_s, self.renew_s, self.renew_deadline_s, self.clock = duration_s, renew_s, renew_deadline_s, clock
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def try_acquire(self, timeout: float = 30.0) -> bool:
        """One attempt: take the Lease when it is free, expired or ours; renew it when ours. Each API request
        waits at most `timeout` seconds."""
        now = self.clock()
        lease = self.kube.get("Lease", self.namespace, self.name, timeout=timeout)
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.duration_s),
                "renewTime": _micro(now)}
        if lease is None:
            body: Obj = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                         "metadata": {"name": self.name, "namespace": self.namespace},
                         "spec": {**spec, "acquireTime": _micro(now), "leaseTransitions": 0}}
            try:
                self.kube.request("POST", path("Lease", self.namespace), body, timeout=timeout)
                return True
            except KubeError as e:
                if e.status == 409:
                    return False
                raise
        held = lease.get("spec") or {}
        holder = held.get("holderIdentity")
        expires = _parse(held.get("renewTime")) + float(held.get("leaseDurationSeconds") or self.duration_s)
        if holder and holder != self.identity and now < expires:
            return False
        new_spec = {**held, **spec}
        if holder != self.identity:
            new_spec["acquireTime"] = _micro(now)
            new_spec["leaseTransitions"] = int(held.get("leaseTransitions") or 0) + 1
        lease["spec"] = new_spec
        try:
            self.kube.request("PUT", path("Lease", self.namespace, self.name), lease, timeout=timeout)
            return True
        except KubeError as e:
            if e.status == 409:
                return False
            raise

    def acquire(self, stop: threading.Event, on_wait: Callable[[str], None] = lambda _: None) -> bool:
        """Block until this replica leads (True) or `stop` is set (False)."""
        announced = False
        while not stop.is_set():
            try:
                if self.try_acquire():
                    log.info("leading as %s (lease %s/%s)", self.identity, self.namespace, self.name)
                    return True
            except KubeError as e:
                log.warning("lease %s/%s: %s", self.namespace, self.name, e)
            if not announced:
                on_wait(f"waiting for the lease {self.namespace}/{self.name}")
                announced = True
            stop.wait(self.renew_s / 2)
        return False

    def start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew, name="lease-renew", daemon=True)
        self._thread.start()

    def _renew(self) -> None:
        last = self.clock()
        while not self._stop.wait(self.renew_s):
            renewed = self.renew(last)
            if renewed is None:
                self.lost.set()
                return
            last = renewed

    def renew(self, last: float) -> float | None:
        """One renewal by the holder, whose last one succeeded at `last`: the time of the latest success, or None
        when this replica must stop acting (the Lease was taken, or `renew_deadline_s` passed without a renewal)."""
        left = self.renew_deadline_s - (self.clock() - last)
        try:
            if left > 0 and self.try_acquire(timeout=max(left, 0.5)):
                return self.clock()
            if left > 0:
                log.error("lease %s/%s was taken by another replica", self.namespace, self.name)
                return None
        except Exception as e:  # an API error or a timeout: retried until the deadline
            log.warning("renewing lease %s/%s: %s", self.namespace, self.name, e)
        if self.clock() - last < self.renew_deadline_s:
            return last
        log.error("lease %s/%s not renewed for %.0f s (the renew deadline): stepping down", self.namespace,
                  self.name, self.clock() - last)
        return None

    def release(self) -> None:
        """Stop renewing and hand the Lease over at once (holder cleared) when still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        try:
            lease = self.kube.get("Lease", self.namespace, self.name)
            if lease and (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = None
                self.kube.request("PUT", path("Lease", self.namespace, self.name), lease)
        except KubeError as e:
            log.warning("releasing lease %s/%s: %s", self.namespace, self.name, e)
