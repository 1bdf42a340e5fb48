"""A pod's status as a kubelet reports it, from what its containers are doing; restart policy and back-off. Pure.

A container is, at any time, in one state (as in `containerStatuses[].state`):
- waiting: not started yet (`ContainerCreating`, `PodInitializing`, `CreateContainerConfigError`), or waiting to be
  restarted after an exit (`CrashLoopBackOff`; its exit is then in `lastState`);
- running, since `startedAt`;
- terminated, for good (the restart policy does not restart it, or the pod is being deleted).

Phase (Kubernetes' rules): Pending while an init container has not succeeded or an app container has not started
yet; Running while a container runs or will restart; once every container is terminated for good, Succeeded if all
exited 0, else Failed (with `restartPolicy: Always` that happens only when the pod is being deleted). An init
container that fails for good (`restartPolicy: Never`) fails the pod.

Conditions: PodReadyToStartContainers (the pod has its IP), Initialized (every init container succeeded),
ContainersReady (every app container is ready: running, and its readiness probe passing if it has one), Ready
(ContainersReady and every readiness gate's condition True); conditions written by others (PodScheduled, the
gates) are kept. `lastTransitionTime` moves only when a condition's status does.

Back-off: the n-th restart of a container waits `base * 2**(n-1)` seconds, at most `cap` (Kubernetes: 10 s and
300 s), counted again from the start once a run lasted `reset` seconds.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Obj = Mapping[str, Any]


@dataclass(frozen=True)
class Backoff:
    base: float = 10.0
    cap: float = 300.0
    reset: float = 600.0

    def delay(self, step: int) -> float:
        """Seconds before a restart, `step` restarts into the current crash loop (0 for the first)."""
        return float(min(self.cap, self.base * 2 ** min(step, 64)))


def should_restart(policy: str, exit_code: int, *, init: bool = False) -> bool:
    if init:
        return exit_code != 0 and policy != "Never"
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


def exit_code_of(returncode: int) -> int:
    """A process's exit as a container runtime reports it: a signal N reads as 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def terminated(exit_code: int, *, started_at: str, finished_at: str, container_id: str,
               reason: str | None = None, message: str = "") -> dict[str, Any]:
    state: dict[str, Any] = {"exitCode": exit_code, "reason": reason or ("Completed" if exit_code == 0 else "Error"),
                             "startedAt": started_at, "finishedAt": finished_at, "containerID": container_id}
    if exit_code > 128 and exit_code - 128 < signal.NSIG:
        state["signal"] = exit_code - 128
    if message:
        state["message"] = message
    return state


@dataclass(frozen=True)
class ContainerView:
    """What one container is doing, as `containerStatuses[]` shows it."""

    name: str
    image: str = ""
    state: Mapping[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: Mapping[str, Any] = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    restart_count: int = 0
    container_id: str = ""

    @property
    def kind(self) -> str:
        return next(iter(self.state), "waiting")

    @property
    def exit_code(self) -> int | None:
        return self.state["terminated"]["exitCode"] if self.kind == "terminated" else None

    def as_status(self) -> dict[str, Any]:
        status: dict[str, Any] = {"name": self.name, "image": self.image, "imageID": "", "state": dict(self.state),
                                  "lastState": dict(self.last_state), "ready": self.ready,
                                  "restartCount": self.restart_count, "started": self.started}
        if self.container_id:
            status["containerID"] = self.container_id
        return status


def pod_phase(policy: str, init: Sequence[ContainerView], main: Sequence[ContainerView], *,
              terminating: bool = False) -> str:
    if any(view.exit_code != 0 for view in init):
        return "Failed" if any(v.exit_code not in (None, 0) for v in init) else "Pending"
    restarting = [v for v in main if v.kind == "waiting" and v.last_state]
    if any(v.kind == "waiting" and not v.last_state for v in main):
        return "Pending"
    if any(v.kind == "running" for v in main) or (restarting and not terminating):
        return "Running"
    succeeded = all(v.exit_code == 0 for v in main)
    if terminating or policy == "Never":
        return "Succeeded" if succeeded else "Failed"
    if policy == "OnFailure":
        return "Succeeded" if succeeded else "Running"
    return "Running"


def _condition(kind: str, ok: bool, reason: str = "", message: str = "") -> dict[str, Any]:
    condition: dict[str, Any] = {"type": kind, "status": "True" if ok else "False"}
    if not ok and reason:
        condition["reason"] = reason
    if not ok and message:
        condition["message"] = message
    return condition


def pod_conditions(pod: Obj, init: Sequence[ContainerView], main: Sequence[ContainerView], phase: str,
                   now: str) -> list[dict[str, Any]]:
    existing = {c.get("type"): c for c in (pod.get("status") or {}).get("conditions") or []}
    done = phase in ("Succeeded", "Failed")
    incomplete = [v.name for v in init if v.exit_code != 0]
    unready = [v.name for v in main if not v.ready]
    containers_ready = _condition("ContainersReady", not unready, "PodCompleted" if done else "ContainersNotReady",
                                  "" if done else f"containers with unready status: [{' '.join(unready)}]")
    gates = [g.get("conditionType") for g in (pod.get("spec") or {}).get("readinessGates") or []]
    closed = [g for g in gates if (existing.get(g) or {}).get("status") != "True"]
    if unready or not closed:
        ready = {**containers_ready, "type": "Ready"}
    else:
        ready = _condition("Ready", False, "ReadinessGatesNotReady",
                           f"corresponding condition of pod readiness gate \"{closed[0]}\" does not exist.")
    mine = [_condition("PodReadyToStartContainers", True),
            _condition("Initialized", not incomplete, "ContainersNotInitialized",
                       f"containers with incomplete status: [{' '.join(incomplete)}]"),
            ready, containers_ready]
    for condition in mine:
        before = existing.get(condition["type"]) or {}
        same = before.get("status") == condition["status"] and before.get("lastTransitionTime")
        condition.update(lastProbeTime=None, lastTransitionTime=before["lastTransitionTime"] if same else now)
    kept = [c for kind, c in existing.items() if kind not in {c["type"] for c in mine}]
    return [*mine, *kept]


def pod_status(pod: Obj, init: Sequence[ContainerView], main: Sequence[ContainerView], *, pod_ip: str,
               host_ip: str, start_time: str, now: str, terminating: bool = False) -> dict[str, Any]:
    policy = (pod.get("spec") or {}).get("restartPolicy") or "Always"
    phase = pod_phase(policy, init, main, terminating=terminating)
    status: dict[str, Any] = {
        "phase": phase, "conditions": pod_conditions(pod, init, main, phase, now),
        "hostIP": host_ip, "hostIPs": [{"ip": host_ip}], "podIP": pod_ip, "podIPs": [{"ip": pod_ip}],
        "startTime": start_time, "containerStatuses": [view.as_status() for view in main],
    }
    if init:
        status["initContainerStatuses"] = [view.as_status() for view in init]
    return status
