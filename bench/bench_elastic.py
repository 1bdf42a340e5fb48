"""`make bench-elastic`: elastic EP on the local cluster with tiny-moe (tp=2, 2 GPUs per pod), next to deleting
and recreating the deployment at the new size (figures go into the README).

- scale-up 2 -> 4 DPA groups: the pause (stop-the-world, from the agents' Resume) and the whole operation;
- scale-down 4 -> 2 in drain mode: the whole operation;
- a killed rank process and a deleted pod: from the fault to the first answer to a request sent after it (the
  survivors' world serving), and to the deployment back at its size (the scale-up that replaces the lost pod);
- a rolling update (an annotation of the pod template changed): one group replaced at a time while the other
  serves, from the change until every pod has the new template, with requests sent one after another all along
  (how many failed, the longest pause);
- recreate: the deployment deleted and applied again at 4 groups, until Available (what an operator without
  elastic EP does).
Targets: the pause under 10% of the recreate time; serving again within 5% of it, full size within 50%.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from shardwise.agents.auth import auth_from_secret
from shardwise.agents.client import AgentClient
from shardwise.devcluster.session import LocalSession

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "elastic.json"
EXAMPLE = yaml.safe_load((ROOT / "examples" / "tiny-moe.yaml").read_text())


def manifest(name: str, dpa: int) -> str:
    body = json.loads(json.dumps(EXAMPLE))
    body["metadata"]["name"] = name
    body["spec"]["parallelism"]["dpa"] = dpa
    return yaml.safe_dump(body)


def available(st: dict[str, Any], dpa: int) -> bool:
    return st.get("phase") == "Running" and st.get("dpa") == dpa and any(
        c["type"] == "Available" and c["status"] == "True" for c in st.get("conditions") or [])


def wait(s: LocalSession, name: str, check: Any, what: str, timeout: float = 300) -> dict[str, Any]:
    return s.wait_for(lambda: (st := s.status(name)) and check(st) and st, timeout, what, interval=0.05)  # type: ignore


def events(s: LocalSession, name: str) -> list[dict[str, Any]]:
    items = (s.get("events") or {}).get("items", [])
    return sorted((e for e in items if e.get("involvedObject", {}).get("name") == name),
                  key=lambda e: (e.get("lastTimestamp") or "", e["metadata"].get("resourceVersion", "")))


def answered(url: str) -> bool:
    """One greedy completion through the deployment's URL, as a client that does not retry."""
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(
        {"prompt": "are you back?", "max_tokens": 4, "temperature": 0}).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def lost_and_back(s: LocalSession, name: str, fault: Any) -> tuple[float, float, dict[str, Any]]:
    """Seconds from the fault to the first answer to a request sent after it (requests one after another), and
    to the deployment back at its size (the survivors' world, then the scale-up that replaces what was lost)."""
    st = s.status(name)
    url, world, dpa = st["url"], st["worldGeneration"], st["dpa"]
    started = time.monotonic()
    fault()
    while not answered(url):
        if time.monotonic() - started > 300:
            raise TimeoutError("no answer 300 s after the fault")
    serving = round(time.monotonic() - started, 2)
    st = wait(s, name, lambda st: available(st, dpa) and st["worldGeneration"] >= world + 2
              and st["elastic"].get("operation") == "ScaleUp" and st["elastic"].get("phase") == "Done", "back at size")
    return serving, round(time.monotonic() - started, 2), st


def rolling_update(s: LocalSession, name: str) -> dict[str, Any]:
    """Change a pod annotation and wait until every pod was replaced, group by group, under steady requests."""
    st = s.status(name)
    url, world, dpa = st["url"], st["worldGeneration"], st["dpa"]
    counts = {"answered": 0, "failed": 0}
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            counts["answered" if answered(url) else "failed"] += 1

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    started = time.monotonic()
    s.kubectl("patch", "idep", name, "--type", "merge", "-p",
              json.dumps({"spec": {"runtime": {"pod": {"annotations": {"bench/revision": str(world)}}}}}))
    wait(s, name, lambda st: available(st, dpa) and st["worldGeneration"] == world + dpa, "rolled group by group")
    took = round(time.monotonic() - started, 2)
    stop.set()
    thread.join(150)
    replaced = [e["message"] for e in events(s, name) if e["reason"] == "GroupsReplaced"][-dpa:]
    pauses = [float(m.rsplit("pause ", 1)[1].split(" s")[0]) for m in replaced]
    return {"rolling_update_s": took, "rolling_update_groups": len(replaced),
            "rolling_update_max_pause_s": max(pauses, default=0.0), **{f"rolling_update_requests_{k}": v
                                                                       for k, v in counts.items()}}


def main() -> None:
    results: dict[str, Any] = {"machine": f"{os.cpu_count()} cpus", "model": "tiny-moe tp=2, 2 GPUs per pod"}
    with tempfile.TemporaryDirectory() as tmp, LocalSession(tmp, nodes=2, gpus_per_node=4,
                                                            operator_env={"SHARDWISE_EPLB_CHECK_SECONDS": "3600"}) as s:
        s.kubectl("apply", "--validate=false", "-f", "-", input=manifest("bench", 2))
        wait(s, "bench", lambda st: available(st, 2), "Available at 2")

        started = time.monotonic()
        s.kubectl("scale", "idep", "bench", "--replicas", "4")
        st = wait(s, "bench", lambda st: available(st, 4) and st["elastic"].get("phase") == "Done", "scaled to 4")
        results["scale_up_2_to_4_s"] = round(time.monotonic() - started, 2)
        results["scale_up_pause_s"] = st["elastic"]["lastPauseSeconds"]
        results["scale_up_operation_s"] = st["elastic"]["lastDurationSeconds"]

        started = time.monotonic()
        s.kubectl("scale", "idep", "bench", "--replicas", "2")
        st = wait(s, "bench", lambda st: available(st, 2) and st["elastic"].get("operation") == "ScaleDown"
                  and st["elastic"].get("phase") == "Done", "scaled to 2")
        results["scale_down_4_to_2_drain_s"] = round(time.monotonic() - started, 2)
        results["scale_down_pause_s"] = st["elastic"]["lastPauseSeconds"]

        token = auth_from_secret(s.get("secret", "bench-agent-token")["data"])

        def kill_rank() -> None:
            ip = s.get("pod", "bench-1")["status"]["podIP"]
            with AgentClient(f"{ip}:50051", token) as c:
                pid = c.health().ranks[0].pid
            os.kill(pid, signal.SIGKILL)

        def delete_pod() -> None:
            s.kubectl("delete", "pod", "bench-1", "--wait=false")

        for what, fault in (("killed_rank", kill_rank), ("deleted_pod", delete_pod)):
            serving, full, st = lost_and_back(s, "bench", fault)
            results[f"{what}_serving_again_s"] = serving
            results[f"{what}_full_size_s"] = full
            results[f"{what}_recovery"] = next(e["message"] for e in reversed(events(s, "bench"))
                                               if e["reason"] == "Recovered")

        results.update(rolling_update(s, "bench"))

        s.kubectl("delete", "idep", "bench", "--wait=true", timeout=120)
        s.wait_for(lambda: not [p for p in (s.get("pods") or {}).get("items", [])], 120, "pods gone")
        started = time.monotonic()
        s.kubectl("apply", "--validate=false", "-f", "-", input=manifest("bench", 4))
        wait(s, "bench", lambda st: available(st, 4), "recreated at 4")
        results["recreate_at_4_s"] = round(time.monotonic() - started, 2)
        s.kubectl("delete", "idep", "bench", "--wait=true", timeout=120)
    results["pause_over_recreate"] = round(results["scale_up_pause_s"] / results["recreate_at_4_s"], 3)
    for what in ("killed_rank", "deleted_pod"):
        for when in ("serving_again", "full_size"):
            results[f"{what}_{when}_over_recreate"] = round(results[f"{what}_{when}_s"] / results["recreate_at_4_s"], 3)
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
