"""`make bench-elastic`: elastic EP on the local cluster with tiny-moe (tp=2, 2 GPUs per pod), next to deleting
and recreating the deployment at the new size (figures go into the README).

- scale-up 2 -> 4 DPA groups: the pause (stop-the-world, from the agents' Resume) and the whole operation;
- scale-down 4 -> 2 in drain mode: the whole operation;
- recovery from a killed rank process: from the kill to the deployment serving again (the re-formed world),
  and the switch itself;
- recreate: the deployment deleted and applied again at 4 groups, until Available (what an operator without
  elastic EP does).
Target: the pause under 10% of the recreate time, recovery under 25% of it.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
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

        token = base64.b64decode(s.get("secret", "bench-agent-token")["data"]["token"]).decode()
        ip = s.get("pod", "bench-1")["status"]["podIP"]
        with AgentClient(f"{ip}:50051", token) as c:
            pid = c.health().ranks[0].pid
        started = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        st = wait(s, "bench", lambda st: available(st, 2) and st["elastic"].get("operation") == "Recover"
                  and st["elastic"].get("phase") == "Done", "recovered")
        results["recovery_killed_rank_s"] = round(time.monotonic() - started, 2)
        results["recovery_switch_s"] = st["elastic"]["lastPauseSeconds"]

        s.kubectl("delete", "idep", "bench", "--wait=true", timeout=120)
        s.wait_for(lambda: not [p for p in (s.get("pods") or {}).get("items", [])], 120, "pods gone")
        started = time.monotonic()
        s.kubectl("apply", "--validate=false", "-f", "-", input=manifest("bench", 4))
        wait(s, "bench", lambda st: available(st, 4), "recreated at 4")
        results["recreate_at_4_s"] = round(time.monotonic() - started, 2)
        s.kubectl("delete", "idep", "bench", "--wait=true", timeout=120)
    results["pause_over_recreate"] = round(results["scale_up_pause_s"] / results["recreate_at_4_s"], 3)
    results["recovery_over_recreate"] = round(results["recovery_killed_rank_s"] / results["recreate_at_4_s"], 3)
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
