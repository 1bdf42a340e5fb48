"""Where a pending pod goes: the scheduler's decisions as pure functions of the pod, the nodes and what the pods
already bound to each node request (no I/O; scheduler.py observes and applies).

Glossary, as in Kubernetes:
- requests: what a pod asks of a node, per resource; a container's limit stands for its request where it states
  none (the API server's defaulting), the pod's requests are the sum over its containers or the largest init
  container, whichever is larger, plus one of the node's `pods` slots.
- allocatable: what a node offers (`status.allocatable`, else `status.capacity`).
- used: the requests of the pods bound to a node that have not terminated (a pod being deleted still holds its
  share until it is gone), so an extended resource such as `nvidia.com/gpu` is never booked twice.

Filters, in Kubernetes' order; a node is out at the first filter it fails, with that filter's reasons:
1. `spec.unschedulable` (unless the pod tolerates `node.kubernetes.io/unschedulable`);
2. taints with effect NoSchedule or NoExecute that the pod does not tolerate; a node whose Ready condition is
   not True counts as tainted `node.kubernetes.io/not-ready:NoSchedule`, as the node lifecycle controller taints it;
3. `nodeSelector` and required node affinity (`matchExpressions` on labels, `matchFields` on `metadata.name`);
4. resources: every requested resource must fit in allocatable minus used (one reason per short resource).

Among the nodes left, the least allocated one wins (Kubernetes' default score: the mean free fraction of cpu,
memory and the extended resources the pod requests, after placing it); ties go to the first name. A pod that
fits nowhere gets the message Kubernetes writes, e.g. `0/2 nodes are available: 2 Insufficient nvidia.com/gpu.`
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from shardwise.api import parse_quantity

Obj = Mapping[str, Any]
Resources = dict[str, Fraction]

GPU = "nvidia.com/gpu"
NOT_READY = "node.kubernetes.io/not-ready"
UNSCHEDULABLE = "node.kubernetes.io/unschedulable"
TERMINATED = ("Succeeded", "Failed")

def _resources(table: Mapping[str, Any] | None) -> Resources:
    return {name: parse_quantity(value) for name, value in (table or {}).items()}


def container_requests(container: Obj) -> Resources:
    resources = container.get("resources") or {}
    return {**_resources(resources.get("limits")), **_resources(resources.get("requests"))}


def pod_requests(pod: Obj) -> Resources:
    spec = pod.get("spec") or {}
    total: Resources = {}
    for container in spec.get("containers") or []:
        for name, amount in container_requests(container).items():
            total[name] = total.get(name, Fraction(0)) + amount
    for container in spec.get("initContainers") or []:
        for name, amount in container_requests(container).items():
            total[name] = max(total.get(name, Fraction(0)), amount)
    for name, amount in _resources(spec.get("overhead")).items():
        total[name] = total.get(name, Fraction(0)) + amount
    total["pods"] = total.get("pods", Fraction(0)) + 1
    return total


def allocatable(node: Obj) -> Resources:
    status = node.get("status") or {}
    return _resources(status.get("allocatable") or status.get("capacity"))


def usage(pods: Iterable[Obj], assumed: Mapping[str, str] | None = None) -> dict[str, Resources]:
    """What the pods holding resources use on each node. `assumed` maps pod uids to the nodes they were just bound
    to, before the binding shows in the pods observed."""
    assumed = assumed or {}
    used: dict[str, Resources] = {}
    for pod in pods:
        uid = (pod.get("metadata") or {}).get("uid", "")
        node = (pod.get("spec") or {}).get("nodeName") or assumed.get(uid)
        phase = (pod.get("status") or {}).get("phase")
        if not node or phase in TERMINATED:
            continue
        table = used.setdefault(node, {})
        for name, amount in pod_requests(pod).items():
            table[name] = table.get(name, Fraction(0)) + amount
    return used


# -- filters ------------------------------------------------------------------------------------------------------


def is_ready(node: Obj) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def effective_taints(node: Obj) -> list[Obj]:
    """The node's taints, with the one Kubernetes' node lifecycle controller puts on a node that is not Ready."""
    taints: list[Obj] = list((node.get("spec") or {}).get("taints") or [])
    if not is_ready(node) and not any(t.get("key") == NOT_READY for t in taints):
        taints.append({"key": NOT_READY, "effect": "NoSchedule"})
    return taints


def tolerates(tolerations: Sequence[Obj], taint: Obj) -> bool:
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
            continue
        key, operator = toleration.get("key") or "", toleration.get("operator") or "Equal"
        if operator == "Exists" and (not key or key == taint.get("key")):
            return True
        if operator == "Equal" and key == taint.get("key") and (toleration.get("value") or "") == (
                taint.get("value") or ""):
            return True
    return False


def _labels(obj: Obj) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("labels") or {}


def _expression_holds(expression: Obj, value: str | None) -> bool:
    operator, values = expression.get("operator"), list(expression.get("values") or [])
    if operator == "In":
        return value in values
    if operator == "NotIn":
        return value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt") and value is not None and values:
        try:
            number, bound = int(value), int(values[0])
        except ValueError:
            return False
        return number > bound if operator == "Gt" else number < bound
    return False


def _term_holds(term: Obj, node: Obj) -> bool:
    labels = _labels(node)
    fields = {"metadata.name": (node.get("metadata") or {}).get("name")}
    return (all(_expression_holds(e, labels.get(e.get("key", ""))) for e in term.get("matchExpressions") or [])
            and all(_expression_holds(e, fields.get(e.get("key", ""))) for e in term.get("matchFields") or []))


def matches_node(pod: Obj, node: Obj) -> bool:
    """`nodeSelector` (every label equal) and required node affinity (any of its terms)."""
    spec = pod.get("spec") or {}
    labels = _labels(node)
    if any(labels.get(key) != value for key, value in (spec.get("nodeSelector") or {}).items()):
        return False
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    terms = required.get("nodeSelectorTerms") or []
    return not terms or any(_term_holds(term, node) for term in terms)


def _taint_text(taint: Obj) -> str:
    return f"{{{taint.get('key')}: {taint.get('value') or ''}}}"


def _resource_order(name: str) -> tuple[int, str]:
    return ({"pods": 0, "cpu": 1, "memory": 2, "ephemeral-storage": 3}.get(name, 4), name)


def unfit_reasons(pod: Obj, node: Obj, used: Resources) -> list[str]:
    """Why the pod cannot go to the node (empty when it can), in the words Kubernetes uses."""
    tolerations = (pod.get("spec") or {}).get("tolerations") or []
    if (node.get("spec") or {}).get("unschedulable") and not tolerates(
            tolerations, {"key": UNSCHEDULABLE, "effect": "NoSchedule"}):
        return ["node(s) were unschedulable"]
    for taint in effective_taints(node):
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerates(tolerations, taint):
            return [f"node(s) had untolerated taint {_taint_text(taint)}"]
    if not matches_node(pod, node):
        return ["node(s) didn't match Pod's node affinity/selector"]
    offered = allocatable(node)
    short = [name for name, amount in pod_requests(pod).items()
             if amount > 0 and used.get(name, Fraction(0)) + amount > offered.get(name, Fraction(0))]
    return [("Too many pods" if name == "pods" else f"Insufficient {name}")
            for name in sorted(short, key=_resource_order)]


# -- choice -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """A node for the pod, or None and the reason it fits nowhere."""

    node: str | None
    message: str = ""


def _free_fraction(pod: Obj, node: Obj, used: Resources) -> Fraction:
    requests, offered = pod_requests(pod), allocatable(node)
    names = ["cpu", "memory", *sorted(n for n in requests if "/" in n and requests[n] > 0)]
    fractions = [(offered[n] - used.get(n, Fraction(0)) - requests.get(n, Fraction(0))) / offered[n]
                 for n in names if offered.get(n, Fraction(0)) > 0]
    return sum(fractions, Fraction(0)) / len(fractions) if fractions else Fraction(0)


def unschedulable_message(node_count: int, reasons: Iterable[str]) -> str:
    if node_count == 0:
        return "no nodes available to schedule pods"
    counts = Counter(reasons)
    return (f"0/{node_count} nodes are available: "
            + ", ".join(sorted(f"{count} {reason}" for reason, count in counts.items())) + ".")


def place(pod: Obj, nodes: Sequence[Obj], used: Mapping[str, Resources]) -> Placement:
    """The node the pod goes to (least allocated among those it fits), or why there is none."""
    feasible: list[tuple[Fraction, str]] = []
    reasons: list[str] = []
    for node in nodes:
        name = str((node.get("metadata") or {}).get("name"))
        why = unfit_reasons(pod, node, used.get(name, {}))
        if why:
            reasons.extend(why)
        else:
            feasible.append((-_free_fraction(pod, node, used.get(name, {})), name))
    if feasible:
        return Placement(min(feasible)[1])
    return Placement(None, unschedulable_message(len(nodes), reasons))


def schedulable(pod: Obj, scheduler_names: Iterable[str]) -> bool:
    """Whether the pod waits for this scheduler: not bound, not being deleted, not terminated, and asking for one
    of the scheduler's names (no `schedulerName` means `default-scheduler`)."""
    spec, metadata = pod.get("spec") or {}, pod.get("metadata") or {}
    return (not spec.get("nodeName") and not metadata.get("deletionTimestamp")
            and (pod.get("status") or {}).get("phase", "Pending") == "Pending"
            and (spec.get("schedulerName") or "default-scheduler") in set(scheduler_names))


def queue_order(pod: Obj) -> tuple[int, str, str, str]:
    """Higher priority first, then the oldest."""
    metadata = pod.get("metadata") or {}
    return (-int((pod.get("spec") or {}).get("priority") or 0), str(metadata.get("creationTimestamp") or ""),
            str(metadata.get("namespace") or ""), str(metadata.get("name") or ""))


def unschedulable_condition(pod: Obj, message: str, now: str) -> dict[str, Any] | None:
    """The PodScheduled condition to write for an unschedulable pod, or None when the pod already shows it."""
    current: Mapping[str, Any] = next((c for c in (pod.get("status") or {}).get("conditions") or []
                    if c.get("type") == "PodScheduled"), {})
    wanted = {"status": "False", "reason": "Unschedulable", "message": message}
    if all(current.get(k) == v for k, v in wanted.items()):
        return None
    since = current.get("lastTransitionTime") if current.get("status") == "False" else None
    return {"type": "PodScheduled", **wanted, "lastProbeTime": None, "lastTransitionTime": since or now}
