"""What the operator reads from and writes into an InferenceDeployment's status, shared by the reconcile step,
the elastic state machine and the router sync: status timestamps, conditions, merge patches, a world's layout
(`status.pods`) and whether a pod is Ready. Pure functions of plain objects; nothing here calls the API."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from .kube import Obj

STAMP = "%Y-%m-%dT%H:%M:%SZ"


def iso_at(t: float) -> str:
    """A status timestamp: `t` (seconds since the epoch) in UTC, to the millisecond (what an operation's phases
    count from: a recovery's survivor is restarted `SURVIVOR_STUCK_S` after its start, not up to a second
    sooner)."""
    d = dt.datetime.fromtimestamp(t, dt.UTC)
    return f"{d.strftime('%Y-%m-%dT%H:%M:%S')}.{d.microsecond // 1000:03d}Z"


def now_iso() -> str:
    """Now, to the second (a condition's lastTransitionTime, as Kubernetes writes them)."""
    return dt.datetime.now(dt.UTC).strftime(STAMP)


def seconds_at(value: str) -> float:
    """Seconds since the epoch of a status timestamp, to the second or finer (an older operator wrote seconds)."""
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(dt.UTC).timestamp()


def parse_iso(value: str | None) -> float | None:
    """`seconds_at`, or None for no timestamp."""
    return seconds_at(value) if value else None


def eplb_busy(st: Mapping[str, Any], now: float) -> bool:
    """A rebalance is moving experts: `status.eplb.inProgress` with its `inProgressDeadline` not passed. A mark past
    its deadline (or without one) was left by an operator that died mid-rebalance and holds nothing back."""
    e = st.get("eplb") or {}
    deadline = parse_iso(e.get("inProgressDeadline"))
    return bool(e.get("inProgress")) and deadline is not None and now < deadline


def set_condition(conditions: list[Obj], type_: str, status: str, reason: str, message: str,
                  generation: int | None) -> list[Obj]:
    """Conditions with `type_` set; lastTransitionTime moves only when its status changes."""
    out = [dict(c) for c in conditions if c.get("type") != type_]
    old = next((c for c in conditions if c.get("type") == type_), None)
    since = old.get("lastTransitionTime") if old and old.get("status") == status else now_iso()
    out.append({"type": type_, "status": status, "reason": reason, "message": message,
                "observedGeneration": generation, "lastTransitionTime": since})
    order = {"Available": 0, "Progressing": 1, "Degraded": 2}
    return sorted(out, key=lambda c: (order.get(c["type"], 9), c["type"]))


def merge_diff(old: Obj, new: Obj) -> Obj:
    """The JSON merge patch that turns `old` into `new`: nested maps patched key by key, keys that went away set
    to null (a merge patch of a map keeps every key it does not name), anything else replaced whole."""
    out: Obj = {}
    for k, v in new.items():
        o = old.get(k)
        if o == v:
            continue
        out[k] = merge_diff(o, v) if isinstance(o, dict) and isinstance(v, dict) else v
    out.update({k: None for k in old if k not in new})
    return out


def pod_ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def agent_address(pod: Obj, port: int) -> str:
    """host:port of a pod's node agent (gRPC)."""
    return f"{(pod.get('status') or {}).get('podIP')}:{port}"


def layout_of(st: Obj) -> dict[int, list[int]]:
    """Pod index -> its ranks in the configured world (from status.pods)."""
    return {int(e["index"]): [int(r) for r in e.get("ranks") or []] for e in st.get("pods") or []}


def encode_layout(layout: dict[int, list[int]]) -> dict[str, list[int]]:
    """A layout as a status map (JSON keys are strings)."""
    return {str(i): r for i, r in sorted(layout.items())}


def decode_layout(layout: dict[str, list[int]]) -> dict[int, list[int]]:
    return {int(i): [int(x) for x in r] for i, r in layout.items()}
