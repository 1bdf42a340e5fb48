"""`make bench-elastic`: elastic EP on the local cluster with tiny-moe (tp=2, 2 GPUs per pod), next to deleting
and recreating the deployment at the new size (figures go into the README).

- scale-up 2 -> 4 DPA groups: the pause (stop-the-world, from the agents' Resume) and the whole operation;
- scale-down 4 -> 2 in drain mode: the whole operation;
- a killed rank process, a deleted pod, a hung agent (SIGSTOP) and a lost node (powered off): from the fault (the
  moment the signal or the API's DELETE is sent; finding the victim is not counted) to
  the first answer to a request sent after it (the survivors' world serving), and to the deployment back at its
  size (the scale-up that replaces the lost pod), with the requests of one client that failed meanwhile; a killed
  rank and a deleted pod again with no client, to full size; a deleted pod again, with and without a client,
  beside a standby pod (`spec.elastic.standbyPods: 1`, warm: its agent's Health says so) that the scale-up takes
  instead of starting a pod;
  before the lost node, if no node holds a worker pod alone, the other nodes are cordoned and a worker pod
  deleted so that its replacement lands alone on a free node (reported, not faked, when none is free);
- the operator killed (SIGKILL) while a scale-up prepares, while it switches, and while a scale-down drains, and
  started again at once: time to the operation done, requests failed;
- the operator killed (SIGKILL) while it moves experts (a rebalance from measured load) and started again at once:
  time to a rebalance done by the new process, requests failed;
- a rank killed (SIGKILL) while a rebalance moves experts: time to serving again, to the rebalance's mark cleared
  and to full size, requests failed, how the rebalance ended;
- two operator replicas electing a leader, the leader killed (SIGKILL, its Lease not released) while a scale-up
  prepares: time to the standby leading and to the operation done, requests failed;
- a rank killed and the API server down for 30 s at once (its recovery cut off): time to serving again and to
  full size, from the fault and from the API's return;
- the API server down for 30 s while a scale-up 2 -> 3 prepares (`LocalSession.api_outage`): requests answered
  during the outage and failed overall, time to the scale-up done (from the scale and from the API's return);
- Prometheus down for 30 s with autoscaling on and a load that wants fewer groups: whether the size is held and
  what the user is told, then time from Prometheus' return to a check that reads it and to the scale-down;
- a rolling update (an annotation of the pod template changed): one group replaced at a time while the other
  serves, from the change until every pod has the new template, with requests sent one after another all along
  (how many failed, the longest pause);
- recreate: the deployment deleted and applied again at 4 groups, from the object created (`kubectl apply`
  returned) until Available, and until the first answer to a client that sends requests one after another from
  then on (what an operator without elastic EP does).
Targets: the pause under 10% of the recreate time; serving again within 5% of it, full size within 50%. Serving
again (a first answer) is compared with the recreate's first answer, full size with its Available.

`SHARDWISE_BENCH_KEEP=DIR` runs the local cluster in DIR and leaves it there (the operator's, nodes' and agents'
logs), to read after a run whose figures look wrong; by default it runs in a temporary folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import yaml
from shardwise.agents.auth import auth_from_secret
from shardwise.agents.client import AgentClient
from shardwise.devcluster.cluster import process_env
from shardwise.devcluster.session import LocalSession, shardwise_command

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


class Steady:
    """One client sending requests one after another through the deployment's URL, none retried: when each was
    sent, when its answer came, and whether it was a 200."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.log: list[tuple[float, float, bool]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            sent = time.monotonic()
            ok = answered(self.url)
            self.log.append((sent, time.monotonic(), ok))

    def first_answer_after(self, t: float) -> float | None:
        return next((done for sent, done, ok in list(self.log) if ok and sent > t), None)

    def failed(self) -> int:
        return sum(1 for _sent, _done, ok in self.log if not ok)

    def __enter__(self) -> Steady:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(150)


def done(operation: str, dpa: int) -> Any:
    """The deployment Available at `dpa` with `operation` (ScaleUp, ScaleDown) the last one, ended."""
    return lambda st: (available(st, dpa) and (st.get("elastic") or {}).get("operation") == operation
                       and st["elastic"].get("phase") == "Done")


def back_at_size(world: int, dpa: int) -> Any:
    return lambda st: done("ScaleUp", dpa)(st) and st["worldGeneration"] >= world + 2


def lost_and_back(s: LocalSession, name: str, fault: Callable[[], float]) -> dict[str, Any]:
    """Under one client sending requests one after another: seconds from the fault to the first answer to a
    request sent after it, and to the deployment back at its size (the survivors' world, then the scale-up that
    replaces what was lost); the requests that failed meanwhile."""
    st = s.status(name)
    url, world, dpa = st["url"], st["worldGeneration"], st["dpa"]
    with Steady(url) as client:
        s.wait_for(lambda: client.first_answer_after(0) is not None, 60, "a first answer")
        started = fault()
        first = s.wait_for(lambda: client.first_answer_after(started), 300, "an answer after the fault")
        wait(s, name, back_at_size(world, dpa), "back at size")
        full = time.monotonic() - started
    recovered = next(e["message"] for e in reversed(events(s, name)) if e["reason"] == "Recovered")
    return {"serving_again_s": round(first - started, 2), "full_size_s": round(full, 2),
            "requests_failed": client.failed(), "requests_answered": len(client.log) - client.failed(),
            "recovery": recovered}


def back_without_traffic(s: LocalSession, name: str, fault: Callable[[], float]) -> float:
    """Seconds from the fault to the deployment back at its size with no client sending (nothing served competes
    with the replacement's start for the CPUs)."""
    st = s.status(name)
    started = fault()
    wait(s, name, back_at_size(st["worldGeneration"], st["dpa"]), "back at size")
    return round(time.monotonic() - started, 2)


def delete_now(s: LocalSession, pod: str) -> float:
    """Delete `pod` with one DELETE to the API server, as `kubectl delete pod --wait=false` sends it, and return
    the moment it was sent (kubectl's own start, a tenth of a second or more on 2 busy cores, is not counted)."""
    config = yaml.safe_load(s.kubeconfig.read_text())
    server, token = config["clusters"][0]["cluster"]["server"], config["users"][0]["user"]["token"]
    req = urllib.request.Request(f"{server}/api/v1/namespaces/default/pods/{pod}", method="DELETE",
                                 headers={"Authorization": f"Bearer {token}"})
    struck = time.monotonic()
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()
    return struck


def long_request(url: str) -> None:
    """A completion of 200 tokens through the deployment's URL (seconds on 2 cores), its answer dropped."""
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(
        {"prompt": "hold on", "max_tokens": 200, "temperature": 0}).encode(), {"Content-Type": "application/json"})
    with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError), \
            urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def operator_killed(s: LocalSession, name: str, key: str, phases: tuple[str, ...], target: int,
                    hold: int = 0) -> dict[str, Any]:
    """Scale to `target` under steady requests, SIGKILL the operator once the operation is in one of `phases` and
    start it again at once: the phase caught, seconds from the scale to the operation done, requests failed. A
    phase too short to catch (polled every 20 ms) is reported as such."""
    st = s.status(name)
    operation = "ScaleUp" if target > st["dpa"] else "ScaleDown"
    key = f"operator_killed_{key}"
    seen: list[str] = []

    def caught() -> bool:
        seen.append(str((s.status(name).get("elastic") or {}).get("phase")))
        return seen[-1] in phases

    # `hold` long requests first, one per group (the router sends each to the least loaded): a drain then waits
    # for the leaving group's for seconds instead of being over before a status read can see it
    holders = [threading.Thread(target=long_request, args=(st["url"],), daemon=True) for _ in range(hold)]
    for h in holders:
        h.start()
    if holders:
        time.sleep(1.0)  # (a benchmark's pacing: the requests reach their groups and start decoding)
    with Steady(st["url"]) as client:
        started = time.monotonic()
        s.kubectl("scale", "idep", name, "--replicas", str(target))
        try:
            s.wait_for(caught, 60, " or ".join(phases), interval=0.02)
        except AssertionError:
            return {f"{key}_caught": False, f"{key}_phases_seen": sorted(set(seen))}
        s.kill_operator(signal.SIGKILL)
        s.start_operator()
        st = wait(s, name, done(operation, target), f"{operation} to {target} after the operator restart")
        took = round(time.monotonic() - started, 2)
    for h in holders:
        h.join(300)
    result = {f"{key}_caught": True, f"{key}_phase": seen[-1], f"{key}_s": took,
              f"{key}_requests_failed": client.failed(),
              f"{key}_requests_answered": len(client.log) - client.failed(),
              f"{key}_result": st["elastic"].get("lastResult", "")}
    print(result, file=sys.stderr, flush=True)
    return result


def rebalance_caught(s: LocalSession, name: str, client: Steady) -> bool:
    """Once `client` has sent a few requests, the operator restarted so that its first EPLB check balances the
    world from the load measured so far: whether the experts' move was seen under way (polled every 20 ms)."""
    s.wait_for(lambda: len(client.log) >= 5, 60, "load to measure")
    s.kill_operator(signal.SIGTERM)
    s.start_operator()
    try:
        s.wait_for(lambda: (s.status(name).get("eplb") or {}).get("inProgress"), 60, "a rebalance", interval=0.02)
    except AssertionError:
        return False
    return True


def operator_killed_rebalancing(s: LocalSession, name: str) -> dict[str, Any]:
    """Under steady requests, the operator restarted so that its first EPLB check balances this world from the
    load measured so far, SIGKILLed while the experts move (`status.eplb.inProgress`) and started again at once:
    seconds from the kill to a rebalance done by the new process (the mark cleared), requests failed. A move too
    short to catch (polled every 20 ms) is reported as such."""
    st = s.status(name)
    world, key = st["worldGeneration"], "operator_killed_rebalancing"
    with Steady(st["url"]) as client:
        if not rebalance_caught(s, name, client):
            return {f"{key}_caught": False}
        killed = time.monotonic()
        before = (s.status(name).get("eplb") or {}).get("lastRebalanceTime")
        s.kill_operator(signal.SIGKILL)
        s.start_operator()
        # the killed process wrote neither the world it balanced nor a rebalance time; the new one writes both
        st = wait(s, name, lambda st: (e := st.get("eplb") or {}) and not e.get("inProgress")
                  and (e.get("world") == world or e.get("lastRebalanceTime") != before),
                  "the restarted operator's EPLB check to settle this world")
        took = time.monotonic() - killed
    e = st["eplb"]
    result = {f"{key}_caught": True, f"{key}_s": round(took, 2), f"{key}_requests_failed": client.failed(),
              f"{key}_requests_answered": len(client.log) - client.failed(),
              f"{key}_mark_cleared_by_event": any(ev["reason"] == "RebalanceInterrupted" for ev in events(s, name)),
              f"{key}_result": f"{e.get('lastCheck')}; balance now {e.get('balanceCurrent')}"}
    print(result, file=sys.stderr, flush=True)
    return result


def rank_killed_migrating(s: LocalSession, name: str, kill: Callable[[], float]) -> dict[str, Any]:
    """Under steady requests, the operator restarted so that its first EPLB check balances this world, and one
    rank SIGKILLed (`kill`) while the experts move (`status.eplb.inProgress`): seconds from the kill to the first
    answer, to the mark cleared, and to the deployment back at its size; requests failed; how the rebalance
    ended. A move too short to catch (polled every 20 ms) is reported as such."""
    st = s.status(name)
    world, dpa, key = st["worldGeneration"], st["dpa"], "rank_killed_migrating"
    with Steady(st["url"]) as client:
        if not rebalance_caught(s, name, client):
            return {f"{key}_caught": False}
        killed = kill()
        first = s.wait_for(lambda: client.first_answer_after(killed), 300, "an answer after the kill")
        wait(s, name, lambda st: not (st.get("eplb") or {}).get("inProgress"), "the rebalance's mark cleared")
        cleared = time.monotonic()
        wait(s, name, back_at_size(world, dpa), "back at size")
        full = time.monotonic()
    names = [e["reason"] for e in events(s, name)]
    ended = next((f"{e['reason']}: {e['message']}" for e in reversed(events(s, name))
                  if e["reason"] in ("Rebalanced", "RebalanceFailed")), "no rebalance event")
    result = {f"{key}_caught": True, f"{key}_serving_again_s": round(first - killed, 2),
              f"{key}_mark_cleared_s": round(cleared - killed, 2), f"{key}_full_size_s": round(full - killed, 2),
              f"{key}_requests_failed": client.failed(), f"{key}_requests_answered": len(client.log) - client.failed(),
              f"{key}_rebalance": ended[:160], f"{key}_recovered": "Recovered" in names}
    print(result, file=sys.stderr, flush=True)
    return result


def prometheus_down(s: LocalSession, name: str, seconds: float = 30) -> dict[str, Any]:
    """Autoscaling on with Prometheus down for `seconds` under one client, whose load wants the smallest size:
    the autoscaler holds the size it cannot judge (it says so in status and an Event) instead of reading missing
    series as no load; once Prometheus is back, seconds to the first check that reads it and to the scale-down
    the load asks for; requests failed. Autoscaling is turned off again after."""
    prometheus = s.prometheus
    assert prometheus is not None, "the bench's session runs a Prometheus"
    st = s.status(name)
    dpa, key = st["dpa"], "prometheus_down"
    autoscaling = {"enabled": True, "prometheusUrl": prometheus.url, "targetPerDpa": 100.0,
                   "stabilizationWindowSeconds": 3, "cooldownSeconds": 3, "intervalSeconds": 1}
    checks: set[str] = set()

    def failing(st: dict[str, Any]) -> bool:
        if (mine := st.get("autoscaling") or {}).get("lastError"):
            checks.add(str(mine.get("lastCheck")))
        return bool(checks)

    prometheus.start()  # (stopped since the session started: it adds no load to the other scenarios)
    s.wait_for(lambda: prometheus.query(f'shardwise_world_generation{{deployment="{name}"}}'), 120,
               "Prometheus to scrape the deployment")
    with Steady(st["url"]) as client:
        prometheus.stop()
        down = time.monotonic()
        try:
            s.kubectl("patch", "idep", name, "--type", "merge", "-p",
                      json.dumps({"spec": {"autoscaling": autoscaling}}))
            wait(s, name, failing, "a check that cannot read Prometheus", timeout=120)
            while time.monotonic() - down < seconds:  # the outage lasts `seconds` (the fault, not a wait)
                failing(s.status(name))
                time.sleep(0.5)
            held = s.status(name)["dpa"] == dpa
        finally:
            prometheus.start()
        back = time.monotonic()
        wait(s, name, lambda st: (a := st.get("autoscaling") or {}).get("lastCheck") and not a.get("lastError"),
             "a check that reads Prometheus again", timeout=180)
        reading = time.monotonic()
        wait(s, name, done("ScaleDown", dpa - 1), "the scale-down the load asks for", timeout=180)
        scaled = time.monotonic()
    said = next((e["message"] for e in events(s, name) if e["reason"] == "AutoscalingError"), "no event")
    s.kubectl("patch", "idep", name, "--type", "merge", "-p",
              json.dumps({"spec": {"autoscaling": {"enabled": False}, "parallelism": {"dpa": dpa}}}))
    wait(s, name, done("ScaleUp", dpa), f"back to {dpa}")
    prometheus.stop()
    result = {f"{key}_failed_checks": len(checks), f"{key}_size_held": held, f"{key}_event": said[:200],
              f"{key}_reading_again_s": round(reading - back, 2), f"{key}_scaled_down_s": round(scaled - back, 2),
              f"{key}_requests_failed": client.failed(), f"{key}_requests_answered": len(client.log) - client.failed()}
    print(result, file=sys.stderr, flush=True)
    return result


def leader_killed(s: LocalSession, name: str, target: int) -> dict[str, Any]:
    """Two operator replicas electing a leader on a Lease; the leader SIGKILLed while a scale-up to `target`
    prepares (its new pods start, or their ranks load: with warm rank starts Preparing alone can be too short for
    a status read to see): the standby takes the Lease once it expires (it is not released) and completes the
    operation. Seconds from the kill to the standby leading and to the operation done, requests failed. The
    session's own operator is back (without election) afterwards."""
    s.kill_operator(signal.SIGTERM)
    election = ("--leader-election-name", f"{name}-leader", "--leader-election-namespace", "default")
    leader_log, standby_log = s.operator_log, s.state_dir / "operator-standby.log"
    mark = leader_log.stat().st_size
    s.start_operator(*election)
    s.wait_for(lambda: b"operator: leading" in leader_log.read_bytes()[mark:], 60, "the first replica to lead")
    with open(standby_log, "ab") as out:
        standby = subprocess.Popen([*shardwise_command(), "operator", "--kubeconfig", str(s.kubeconfig), *election],
                                   stdout=out, stderr=subprocess.STDOUT, env=process_env(), start_new_session=True)
    try:
        s.wait_for(lambda: b"waiting for the lease" in standby_log.read_bytes(), 60, "the standby to wait")
        st = s.status(name)
        with Steady(st["url"]) as client:
            s.kubectl("scale", "idep", name, "--replicas", str(target))
            s.wait_for(lambda: (s.status(name).get("elastic") or {}).get("phase") in ("Provisioning", "Preparing"),
                       60, "Provisioning or Preparing", interval=0.02)
            killed = time.monotonic()
            s.kill_operator(signal.SIGKILL)  # the Lease stays held until it expires
            s.wait_for(lambda: b"operator: leading" in standby_log.read_bytes(), 120, "the standby to lead")
            leading = time.monotonic()
            st = wait(s, name, done("ScaleUp", target), f"ScaleUp to {target} by the standby")
            took = time.monotonic()
        result = {"leader_killed_standby_leading_s": round(leading - killed, 2),
                  "leader_killed_scale_up_done_s": round(took - killed, 2),
                  "leader_killed_requests_failed": client.failed(),
                  "leader_killed_requests_answered": len(client.log) - client.failed(),
                  "leader_killed_result": st["elastic"].get("lastResult", "")}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(standby.pid, signal.SIGTERM)
        standby.wait(60)
        s.kill_operator(signal.SIGTERM)  # the leader, where the scenario ended before it was killed
        s.start_operator()
    print(result, file=sys.stderr, flush=True)
    return result


def api_down_during_recovery(s: LocalSession, name: str, fault: Callable[[], float]) -> dict[str, Any]:
    """`fault` (a killed rank), then the API server down for 30 s at once: seconds from the fault to the first
    answer to a request sent after it and to the deployment back at its size, and from the API's return to that
    size; requests failed and answered (during the outage too)."""
    st = s.status(name)
    url, world, dpa = st["url"], st["worldGeneration"], st["dpa"]
    with Steady(url) as client:
        s.wait_for(lambda: client.first_answer_after(0) is not None, 60, "a first answer")
        started = fault()
        s.api_outage(30)
        back = time.monotonic()
        first = s.wait_for(lambda: client.first_answer_after(started), 300, "an answer after the fault")
        # either in place (the killed rank stood by again when the API came back) or survivors first, then a
        # scale-up: a later world at the same size, its operation done
        wait(s, name, lambda st: available(st, dpa) and st["worldGeneration"] > world
             and (st.get("elastic") or {}).get("phase") == "Done", "back at size after the outage")
        full = time.monotonic()
    during = [ok for sent, _done, ok in list(client.log) if started <= sent < back]
    result = {"api_down_recovery_serving_again_s": round(first - started, 2),
              "api_down_recovery_full_size_s": round(full - started, 2),
              "api_down_recovery_full_size_after_api_s": round(full - back, 2),
              "api_down_recovery_requests_answered_during": sum(during),
              "api_down_recovery_requests_failed": client.failed(),
              "api_down_recovery_requests_answered": len(client.log) - client.failed(),
              "api_down_recovery": next(e["message"] for e in reversed(events(s, name)) if e["reason"] == "Recovered")}
    print(result, file=sys.stderr, flush=True)
    return result


def rolling_update(s: LocalSession, name: str) -> dict[str, Any]:
    """Change a pod annotation and wait until every pod was replaced, group by group, under steady requests."""
    st = s.status(name)
    world, dpa = st["worldGeneration"], st["dpa"]
    with Steady(st["url"]) as client:
        started = time.monotonic()
        s.kubectl("patch", "idep", name, "--type", "merge", "-p",
                  json.dumps({"spec": {"runtime": {"pod": {"annotations": {"bench/revision": str(world)}}}}}))
        wait(s, name, lambda st: available(st, dpa) and st["worldGeneration"] == world + dpa, "rolled group by group")
        took = round(time.monotonic() - started, 2)
    replaced = [e["message"] for e in events(s, name) if e["reason"] == "GroupsReplaced"][-dpa:]
    pauses = [float(m.rsplit("pause ", 1)[1].split(" s")[0]) for m in replaced]
    return {"rolling_update_s": took, "rolling_update_groups": len(replaced),
            "rolling_update_max_pause_s": max(pauses, default=0.0),
            "rolling_update_requests_failed": client.failed(),
            "rolling_update_requests_answered": len(client.log) - client.failed()}


def explain(s: LocalSession, name: str) -> None:
    """On a failed wait: the deployment's status, its recent events and the operator log's tail, to stderr."""
    with contextlib.suppress(Exception):
        print(json.dumps(s.status(name), indent=1), file=sys.stderr)
        for e in events(s, name)[-30:]:
            print(e.get("lastTimestamp"), e["reason"], e["message"], file=sys.stderr)
        print("".join(s.operator_log.read_text(errors="replace").splitlines(True)[-150:]), file=sys.stderr)


def run(s: LocalSession, results: dict[str, Any]) -> None:
    """Every scenario, one after another, on one local cluster."""
    # warm (the first world of a session starts colder), then what an operator without elastic EP does:
    # delete and apply again at the new size
    s.kubectl("apply", "-f", "-", input=manifest("bench", 2))
    wait(s, "bench", lambda st: available(st, 2), "Available at 2")
    s.kubectl("delete", "idep", "bench", "--wait=true", timeout=120)
    s.wait_for(lambda: not [p for p in (s.get("pods") or {}).get("items", [])
                            if p["metadata"].get("labels", {}).get("shardwise.io/deployment") == "bench"],
               120, "pods gone")
    s.kubectl("apply", "-f", "-", input=manifest("bench", 4))
    started = time.monotonic()  # from the object created (kubectl's start is not counted, as for the faults)
    answer: list[float] = []  # a client that sends requests one after another as soon as the URL is known

    def first_answer() -> None:
        url = s.wait_for(lambda: s.status("bench").get("url"), 300, "the deployment's URL", interval=0.05)
        while not answered(url):
            time.sleep(0.05)  # a bench's client pacing its tries, not a wait on a condition
        answer.append(time.monotonic())

    client = threading.Thread(target=first_answer, daemon=True)
    client.start()
    wait(s, "bench", lambda st: available(st, 4), "recreated at 4")
    results["recreate_at_4_s"] = round(time.monotonic() - started, 2)
    client.join(300)
    results["recreate_first_answer_s"] = round(answer[0] - started, 2)

    started = time.monotonic()
    s.kubectl("scale", "idep", "bench", "--replicas", "2")
    st = wait(s, "bench", done("ScaleDown", 2), "scaled to 2")
    results["scale_down_4_to_2_drain_s"] = round(time.monotonic() - started, 2)
    results["scale_down_pause_s"] = st["elastic"]["lastPauseSeconds"]

    started = time.monotonic()
    s.kubectl("scale", "idep", "bench", "--replicas", "4")
    st = wait(s, "bench", done("ScaleUp", 4), "scaled to 4")
    results["scale_up_2_to_4_s"] = round(time.monotonic() - started, 2)
    results["scale_up_pause_s"] = st["elastic"]["lastPauseSeconds"]
    results["scale_up_operation_s"] = st["elastic"]["lastDurationSeconds"]
    s.kubectl("scale", "idep", "bench", "--replicas", "2")
    wait(s, "bench", done("ScaleDown", 2), "scaled back to 2")

    token = auth_from_secret(s.get("secret", "bench-agent-token")["data"])

    def victim() -> str:
        """The pod of the last DPA group (a replaced pod takes a new name)."""
        return str(max(s.status("bench")["pods"], key=lambda p: p["ranks"][0])["name"])

    # each fault finds its victim first and returns the moment it struck (time.monotonic()): what the bench
    # spends looking the victim up (kubectl runs) is not the deployment's recovery
    def kill_rank() -> float:
        ip = s.get("pod", victim())["status"]["podIP"]
        with AgentClient(f"{ip}:50051", token) as c:
            pid = c.health().ranks[0].pid
        struck = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        return struck

    def delete_pod() -> float:
        return delete_now(s, victim())

    stopped: list[int] = []
    lost: list[str] = []

    def hang_agent() -> float:
        stopped.append(s.agent_pid("bench", int(victim().rsplit("-", 1)[1])))
        struck = time.monotonic()
        os.kill(stopped[-1], signal.SIGSTOP)  # answers nothing: no HTTP, no gRPC, no probe
        return struck

    def placement() -> dict[str, list[str]]:
        """Each node's pods that are not being deleted (every node listed, those without pods too)."""
        on: dict[str, list[str]] = {n["metadata"]["name"]: [] for n in (s.get("nodes") or {}).get("items", [])}
        for p in (s.get("pods") or {}).get("items", []):
            if not p["metadata"].get("deletionTimestamp") and p["spec"].get("nodeName"):
                on.setdefault(p["spec"]["nodeName"], []).append(p["metadata"]["name"])
        return on

    def worker_alone() -> list[str]:
        workers = {q["name"] for q in s.status("bench")["pods"]}
        return sorted(node for node, names in placement().items() if len(names) == 1 and names[0] in workers)

    def arrange_node_loss() -> None:
        """Make a node hold one worker pod and nothing else, as an admin would: every other node cordoned, the
        last group's pod deleted (the deployment recovers and its replacement can only land on the free node),
        then the cordons lifted. Reported, not faked, when no node is free to take it."""
        results["lost_node_arranged"] = False
        if worker_alone():
            return
        results["lost_node_arranged"] = True
        on = placement()
        free = sorted(node for node, names in on.items() if not names)
        if not free:
            raise LookupError(f"no node holds a worker pod alone and none is free to take one: {on}")
        others = [node for node in on if node != free[0]]
        for node in others:
            s.kubectl("cordon", node)
        try:
            st = s.status("bench")
            s.kubectl("delete", "pod", victim(), "--wait=false")
            wait(s, "bench", back_at_size(st["worldGeneration"], st["dpa"]), "back at size on the free node")
        finally:
            for node in others:
                s.kubectl("uncordon", node)
        if not worker_alone():
            raise LookupError(f"the replacement pod did not land alone on {free[0]}: {placement()}")

    def lose_node() -> float:
        """Power off a node that holds one worker pod and nothing else (the router's node would cut every
        request, which is the router's availability, not the world's)."""
        alone = worker_alone()
        if not alone:
            raise LookupError(f"no node holds a worker pod alone: {placement()}")
        struck = time.monotonic()
        s.cluster.lose_node(alone[-1])  # type: ignore[union-attr]
        lost.append(alone[-1])
        return struck

    def scenario(what: str, fault: Callable[[], float]) -> None:
        try:
            for key, value in lost_and_back(s, "bench", fault).items():
                results[f"{what}_{key}"] = value
            print(what, {k: v for k, v in results.items() if k.startswith(what)}, file=sys.stderr, flush=True)
        except LookupError as e:  # a node-loss scenario the placement does not allow (reported, not faked)
            results[f"{what}_skipped"] = str(e)
        finally:
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    for what, fault in (("killed_rank", kill_rank), ("deleted_pod", delete_pod), ("hung_agent", hang_agent)):
        scenario(what, fault)
    for what, fault in (("killed_rank", kill_rank), ("deleted_pod", delete_pod)):
        results[f"{what}_full_size_without_traffic_s"] = back_without_traffic(s, "bench", fault)

    # the same deleted pod with a standby pod beside the world (spec.elastic.standbyPods: 1): the scale-up that
    # restores the size configures it instead of starting a pod
    def standing_by(st: dict[str, Any]) -> bool:
        return available(st, 2) and bool(st.get("standby")) and (st.get("elastic") or {}).get("phase") == "Done"

    def standby_warm() -> bool:
        """Every running standby pod's agent says its ranks would start warm (its forkserver has imported torch,
        a few seconds after the pod starts): the standby pod is what it promises."""
        pods = [q for q in (s.get("pods") or {}).get("items", []) if q["metadata"]["labels"].get(
            "shardwise.io/role") == "standby" and (q.get("status") or {}).get("podIP")]
        for q in pods:
            with AgentClient(f"{q['status']['podIP']}:50051", token) as c:
                try:
                    if not c.health().warm:
                        return False
                except grpc.RpcError:  # its agent is not listening yet
                    return False
        return bool(pods)

    s.kubectl("patch", "idep", "bench", "--type=merge", "-p", '{"spec": {"elastic": {"standbyPods": 1}}}')
    wait(s, "bench", standing_by, "a standby pod running")
    s.wait_for(standby_warm, 120, "the standby pod warm", interval=0.1)
    scenario("deleted_pod_standby", delete_pod)
    wait(s, "bench", standing_by, "a standby pod running again")
    s.wait_for(standby_warm, 120, "the standby pod warm again", interval=0.1)
    results["deleted_pod_standby_full_size_without_traffic_s"] = back_without_traffic(s, "bench", delete_pod)
    s.kubectl("patch", "idep", "bench", "--type=merge", "-p", '{"spec": {"elastic": {"standbyPods": 0}}}')
    wait(s, "bench", lambda st: available(st, 2) and not st.get("standby") and len(
        [q for q in (s.get("pods") or {}).get("items", []) if q["metadata"]["labels"].get("shardwise.io/role")
         == "standby"]) == 0, "the standby pod gone")

    # the operator killed in each phase of an operation, started again at once: the operation completes
    # (a scale-up prepares in two phases: its new pods start, then their ranks load; either is caught)
    for key, phases, target, hold in (("preparing", ("Provisioning", "Preparing"), 3, 0),
                                      ("switching", ("Switching",), 3, 0), ("draining", ("Draining",), 1, 2)):
        results.update(operator_killed(s, "bench", key, phases, target, hold))
        s.kubectl("scale", "idep", "bench", "--replicas", "2")
        wait(s, "bench", lambda st: available(st, 2) and (st.get("elastic") or {}).get("phase") == "Done",
             "back to 2")

    # the operator killed while its EPLB check moves experts, started again at once
    results.update(operator_killed_rebalancing(s, "bench"))

    # two operator replicas, the leader killed while a scale-up prepares: the standby completes it
    results.update(leader_killed(s, "bench", 3))
    s.kubectl("scale", "idep", "bench", "--replicas", "2")
    wait(s, "bench", done("ScaleDown", 2), "back to 2")

    # a rank killed while the operator's rebalance moves experts (the world just scaled down: its carried map is
    # not balanced for the measured load yet): the move fails, the survivors serve, and the scale-up that follows
    # takes the restarted rank back
    results.update(rank_killed_migrating(s, "bench", kill_rank))

    # a rank killed, then the API server down for 30 s while its recovery runs
    results.update(api_down_during_recovery(s, "bench", kill_rank))

    # the API server down for 30 s while a scale-up 2 -> 3 prepares: the serving world answers throughout
    st = s.status("bench")
    with Steady(st["url"]) as client:
        started = time.monotonic()
        s.kubectl("scale", "idep", "bench", "--replicas", "3")
        wait(s, "bench", lambda st: (st.get("elastic") or {}).get("operation") == "ScaleUp"
             and st["elastic"].get("phase") not in (None, "Done"), "the scale-up started")
        down = time.monotonic()
        s.api_outage(30)
        back = time.monotonic()
        during = [ok for sent, _done, ok in list(client.log) if down <= sent < back]
        wait(s, "bench", done("ScaleUp", 3), "scaled to 3 after the API server's outage")
        results["api_outage_scale_up_s"] = round(time.monotonic() - started, 2)
        results["api_outage_back_to_dpa_3_s"] = round(time.monotonic() - back, 2)
    results["api_outage_requests_answered_during"] = sum(during)
    results["api_outage_requests_failed"] = client.failed()
    results["api_outage_requests_answered"] = len(client.log) - client.failed()
    s.kubectl("scale", "idep", "bench", "--replicas", "2")
    wait(s, "bench", done("ScaleDown", 2), "back to 2")

    # Prometheus down for 30 s while autoscaling is on: the size is held, then the scale-down the load asks for
    results.update(prometheus_down(s, "bench"))

    results.update(rolling_update(s, "bench"))
    print({k: v for k, v in results.items() if k.startswith(("api_outage", "rolling"))}, file=sys.stderr,
          flush=True)
    try:
        arrange_node_loss()
    except LookupError as e:  # reported in the results, not faked
        results["lost_node_skipped"] = str(e)
    else:
        scenario("lost_node", lose_node)  # last: the lost node stays lost (its pods Terminating)
    for q in (s.get("pods") or {}).get("items", []):  # as an admin would, for the deletion below
        if q["spec"].get("nodeName") in lost:
            s.kubectl("delete", "pod", q["metadata"]["name"], "--grace-period=0", "--force", check=False)
    s.kubectl("delete", "idep", "bench", "--wait=true", timeout=120)


def main() -> None:
    results: dict[str, Any] = {"machine": f"{os.cpu_count()} cpus", "model": "tiny-moe tp=2, 2 GPUs per pod",
                               "cluster": "3 process-backed nodes x 4 GPUs, node grace 40 s"}
    keep = os.environ.get("SHARDWISE_BENCH_KEEP")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
    folder = contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory()
    with folder as tmp, LocalSession(tmp, nodes=3, gpus_per_node=4, prometheus=True,
                                     operator_env={"SHARDWISE_EPLB_CHECK_SECONDS": "3600"}) as s:
        s.prometheus.stop()  # started again for its own scenario only
        try:
            run(s, results)
        except Exception:
            explain(s, "bench")
            raise
    # like with like: a first answer to a client over the recreate's first answer, a size in status over the
    # recreate's Available
    recreate, recreate_answer = results["recreate_at_4_s"], results["recreate_first_answer_s"]
    results["pause_over_recreate"] = round(results["scale_up_pause_s"] / recreate, 3)
    for what in ("killed_rank", "deleted_pod", "deleted_pod_standby", "hung_agent", "lost_node"):
        for when in ("serving_again", "full_size", "full_size_without_traffic"):
            if f"{what}_{when}_s" in results:
                over = recreate_answer if when == "serving_again" else recreate
                results[f"{what}_{when}_over_recreate"] = round(results[f"{what}_{when}_s"] / over, 3)
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    print(f"wrote {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
