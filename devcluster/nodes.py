"""A process-backed node as the API sees it: its Node object, its status, its Lease in `kube-node-lease`, and the
pod IPs it hands out. Pure builders; kubelet.py registers, heartbeats and applies them.

- The Node advertises its capacity (cpu, memory, pods and an extended resource, `nvidia.com/gpu` by default),
  its labels (`kubernetes.io/hostname`, `kubernetes.io/os`, `kubernetes.io/arch` and the caller's), its taints
  and a pod CIDR in 127.0.0.0/8, `127.0.N.0/24` (every 127.x.y.z address is this machine's loopback on Linux).
- Heartbeats, as a kubelet sends them: the Lease's `renewTime` every lease interval, and the node status (the
  conditions' `lastHeartbeatTime`) at a slower pace, so that a healthy node writes little.
- Pod IPs: the next free address of the pod CIDR after the last one handed out, so that a deleted pod's address
  is not reused at once.
"""

from __future__ import annotations

import datetime
import ipaddress
import platform
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

KUBELET_VERSION = "v1.32.0"
LEASE_NAMESPACE = "kube-node-lease"


@dataclass(frozen=True)
class NodeConfig:
    """What one node offers. `capacity` holds Kubernetes quantities by resource name."""

    name: str
    capacity: Mapping[str, str]
    pod_cidr: str
    labels: Mapping[str, str] = field(default_factory=dict)
    taints: tuple[Mapping[str, str], ...] = ()


def timestamp(now: datetime.datetime) -> str:
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(now: datetime.datetime) -> str:
    """A MicroTime, as Leases carry it."""
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def build_node(config: NodeConfig) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": config.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": _arch(),
              **config.labels}
    spec: dict[str, Any] = {"podCIDR": config.pod_cidr, "podCIDRs": [config.pod_cidr]}
    if config.taints:
        spec["taints"] = [dict(taint) for taint in config.taints]
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": config.name, "labels": labels}, "spec": spec}


_CONDITIONS = (
    ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
    ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
    ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
)


def node_status(config: NodeConfig, *, ready: bool, now: datetime.datetime,
                previous: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The node's status at a heartbeat; a condition keeps its `lastTransitionTime` while its status holds."""
    stamp = timestamp(now)
    readiness = (("Ready", "True", "KubeletReady", "kubelet is posting ready status") if ready else
                 ("Ready", "Unknown", "NodeStatusUnknown", "Kubelet stopped posting node status."))
    before = {c.get("type"): c for c in (previous or {}).get("conditions") or []}
    conditions = []
    for kind, status, reason, message in (*_CONDITIONS, readiness):
        old = before.get(kind) or {}
        since = old.get("lastTransitionTime") if old.get("status") == status else None
        conditions.append({"type": kind, "status": status, "reason": reason, "message": message,
                           "lastHeartbeatTime": stamp, "lastTransitionTime": since or stamp})
    return {
        "capacity": dict(config.capacity), "allocatable": dict(config.capacity), "conditions": conditions,
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": config.name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},
        "nodeInfo": {"kubeletVersion": KUBELET_VERSION, "kubeProxyVersion": KUBELET_VERSION,
                     "operatingSystem": "linux", "architecture": _arch(), "osImage": platform.platform(),
                     "kernelVersion": platform.release(), "containerRuntimeVersion": "process://shardwise",
                     "machineID": "", "systemUUID": "", "bootID": ""},
    }


def build_lease(node: str, node_uid: str, *, duration: int, now: datetime.datetime) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": node, "namespace": LEASE_NAMESPACE,
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid}]},
        "spec": {"holderIdentity": node, "leaseDurationSeconds": duration, "renewTime": micro_time(now)},
    }


def next_pod_ip(cidr: str, in_use: Collection[str], after: str | None = None) -> str:
    """The first free host address of the CIDR after `after` (wrapping around); raises when all are taken."""
    network = ipaddress.ip_network(cidr)
    hosts = [str(ip) for ip in network.hosts() if str(ip) != "127.0.0.1"]
    start = hosts.index(after) + 1 if after in hosts else 0
    for ip in hosts[start:] + hosts[:start]:
        if ip not in in_use:
            return ip
    raise RuntimeError(f"no free pod IP left in {cidr} ({len(in_use)} in use)")
