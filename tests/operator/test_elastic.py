"""Elastic EP through the operator on the local cluster: dpa changed in place under traffic, drain and abort
scale-downs, a cancelled drain, recovery from a killed rank, an operator killed mid-operation, and the autoscaler
driven by a real Prometheus. Every completion is compared with the single-process oracle."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("kopf")
pytest.importorskip("kmock")

from shardwise.agents.client import AgentClient
from shardwise.devcluster.session import LocalSession

from tests.openai_shape import flat
from tests.operator.common import (
    agent_auth,
    apply,
    assert_serves_like_the_oracle,
    available,
    delete,
    events,
    local_session,
    manifest,
    oracle,
    pods,
    post,
    token,
    uids,
    wait_available,
    wait_status,
)
from tests.runtime.test_recovery import standing_by

pytestmark = pytest.mark.slow
LONG = 200  # tokens: a request that runs for seconds on 2 cores (maxModelLen is 256)


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    yield from local_session(tmp_path_factory, "elastic", operator_env={"SHARDWISE_EPLB_CHECK_SECONDS": "3600"})


def done(operation: str, dpa: int) -> Any:
    return lambda st: (available(st) and st.get("dpa") == dpa and (st.get("elastic") or {}).get("operation")
                       == operation and st["elastic"].get("phase") == "Done")


def pod_url(s: LocalSession, pod: str) -> str:
    return f"http://{s.get('pod', pod)['status']['podIP']}:8000"


def running(url: str, agent_token: str) -> int:
    """Requests running on a pod, from its /v1/stats (a control route: it takes the agent token)."""
    import json
    import urllib.request

    ask = urllib.request.Request(url + "/v1/stats", headers={"Authorization": f"Bearer {agent_token}"})
    with urllib.request.urlopen(ask, timeout=10) as r:
        return int(json.loads(r.read()).get("runningRequests", 0))


def send(url: str, prompt: str, n: int) -> tuple[int, dict[str, Any], str]:
    """A greedy completion through the router, as a client without retries: (code, answer, the group that served
    it). A connection error is the client's loss too: code 0."""
    code, body, group, _world = send_seen(url, prompt, n)
    return code, body, group


def send_seen(url: str, prompt: str, n: int) -> tuple[int, dict[str, Any], str, int]:
    """`send`, and the world generation that took the request (X-Shardwise-World; -1 without an answer)."""
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(
        {"prompt": prompt, "max_tokens": n, "temperature": 0}).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=180) as r:
            return (r.status, flat(json.loads(r.read())), r.headers.get("X-Shardwise-Group", ""),
                    int(r.headers.get("X-Shardwise-World", "-1")))
    except urllib.error.HTTPError as e:
        return e.code, flat(json.loads(e.read() or b"{}")), e.headers.get("X-Shardwise-Group", ""), -1
    except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
        return 0, {"error": f"{type(e).__name__}: {e}"}, "", -1


class Traffic:
    """Completions sent steadily by CLIENTS clients through the deployment's one URL (status.url, its router)
    until stopped. Nothing is retried: every answer that is not a 200 and every connection error is a loss, and
    every answer is checked against the oracle."""

    CLIENTS = 2

    def __init__(self, s: LocalSession, name: str) -> None:
        self.s, self.name = s, name
        self.url = s.status(name)["url"]
        self.ok = 0
        self.groups: set[str] = set()
        # (when the request was sent, the group, the world generation that took it), per right answer
        self.answered: list[tuple[float, str, int]] = []
        self.wrong: list[Any] = []
        self.lost: list[Any] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.run, args=(c,), daemon=True) for c in range(self.CLIENTS)]

    def run(self, client: int) -> None:
        i = 0
        while not self.stop.is_set():
            prompt = f"steady traffic {client}.{i}"
            sent = time.monotonic()
            code, body, group, world = send_seen(self.url, prompt, 12)
            if code != 200:
                self.lost.append((prompt, code, body, group))
            elif body["token_ids"] != oracle(prompt, 12):
                self.wrong.append((prompt, body))
            else:
                self.ok += 1
                self.groups.add(group)
                self.answered.append((sent, group, world))
            i += 1

    def report(self) -> str:
        """Every loss and wrong answer in full, one per line (an assertion's message: pytest shortens a repr)."""
        lines = [f"{self.ok} right answers, {len(self.lost)} lost, {len(self.wrong)} wrong"]
        lines += [f"lost {prompt!r}: HTTP {code} from group {group!r}: {body.get('error', body)}"
                  for prompt, code, body, group in self.lost]
        lines += [f"wrong {prompt!r}: {body.get('token_ids')}" for prompt, body in self.wrong]
        return "\n".join(lines)

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(200)


def test_dpa_grows_and_shrinks_in_place_under_traffic(session: LocalSession) -> None:
    s = session
    apply(s, manifest("el"))
    st = wait_available(s, "el", dpa=2)
    world, before = st["worldGeneration"], uids(s, "el")
    assert st["url"] and st["url"] not in st["endpoints"]  # the router's address, not a group's
    with Traffic(s, "el") as traffic:
        s.kubectl("scale", "inferencedeployment", "el", "--replicas", "4")
        st = wait_status(s, "el", done("ScaleUp", 4), "el scaled up to 4")
        assert st["worldGeneration"] == world + 1 and st["ready"] == "4/4" and len(st["endpoints"]) == 4
        assert "scaled up dpa 2 -> 4" in st["elastic"]["lastResult"] and st["elastic"]["lastPauseSeconds"] > 0
        grown = uids(s, "el")
        assert before.items() <= grown.items() and len(grown) == 4  # the old pods were not restarted
        assert [p["ranks"] for p in st["pods"]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        assert_serves_like_the_oracle(st, "after the scale-up")
        served = traffic.ok
        s.wait_for(lambda: traffic.ok >= served + 8, 60, "traffic to flow through the grown world")
        s.kubectl("scale", "inferencedeployment", "el", "--replicas", "2")
        st = wait_status(s, "el", done("ScaleDown", 2), "el drained down to 2")
        s.wait_for(lambda: uids(s, "el") == before, 60, "the leaving pods to go and the others to stay")
    assert st["worldGeneration"] == world + 2
    assert traffic.ok > 0 and not traffic.wrong and not traffic.lost, traffic.report()
    assert {"2", "3"} <= traffic.groups  # the router sent requests to the groups that joined
    assert s.status("el")["url"] == traffic.url  # one address through both changes
    reasons = [e["reason"] for e in events(s, "el")]
    assert {"ScalingStarted", "ScaledUp", "ScaledDown"} <= set(reasons)
    assert_serves_like_the_oracle(st, "after the scale-down")
    delete(s, "el")


def test_a_pod_template_change_replaces_the_pods_group_by_group_with_no_request_lost(session: LocalSession) -> None:
    s = session
    apply(s, manifest("ru"))
    st = wait_available(s, "ru", dpa=2)
    world, before = st["worldGeneration"], uids(s, "ru")
    rev = {"spec": {"runtime": {"pod": {"annotations": {"example.com/revision": "2"}}}}}

    def rolled() -> dict[str, Any] | None:
        st = s.status("ru")
        if not (available(st) and st["worldGeneration"] == world + 2 and len(pods(s, "ru")) == 2):
            return None
        fresh = all(p["metadata"]["annotations"].get("example.com/revision") == "2" for p in pods(s, "ru"))
        return st if fresh else None

    with Traffic(s, "ru") as traffic:
        s.kubectl("patch", "inferencedeployment", "ru", "--type", "merge", "-p", json.dumps(rev))
        st = s.wait_for(rolled, 300, "every pod replaced by one of the new template, one group at a time")
        served = traffic.ok
        s.wait_for(lambda: traffic.ok >= served + 4, 60, "traffic to flow through the new pods")
    assert not set(uids(s, "ru").values()) & set(before.values())  # every pod was replaced
    assert traffic.ok > 0 and not traffic.wrong and not traffic.lost, traffic.report()
    replaced = [e["message"] for e in events(s, "ru") if e["reason"] == "GroupsReplaced"]
    # two operations of one group each (a world of 2 keeps one serving), not one deletion of every pod
    assert len(replaced) == 2 and any("group(s) [0]" in m for m in replaced) and any(
        "group(s) [1]" in m for m in replaced), replaced
    progressing = next(c for c in st["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] == "Complete", progressing
    assert sorted(p["ranks"] for p in st["pods"]) == [[0, 1], [2, 3]] and st["dpa"] == 2
    assert_serves_like_the_oracle(st, "after the rolling update")
    delete(s, "ru")


def test_abort_mode_ends_only_the_leaving_groups_requests(session: LocalSession) -> None:
    s = session
    apply(s, manifest("ab", eplb={"enabled": False}, elastic={"scaleDown": {"mode": "abort"}}))
    st = wait_available(s, "ab", dpa=2)
    # the mark of a rebalance whose operator died mid-way, its deadline passed: it must not hold the scale back
    s.kubectl("patch", "idep", "ab", "--subresource=status", "--type=merge", "-p",
              json.dumps({"status": {"eplb": {"inProgress": True, "inProgressDeadline": "2026-01-01T00:00:00Z"}}}))
    stay, leave = pod_url(s, "ab-0"), pod_url(s, "ab-1")
    # two long requests through the router: the least-loaded choice puts them on the two groups
    answers: dict[str, Any] = {}
    threads = [threading.Thread(target=lambda k=k: answers.update({k: send(st["url"], f"long {k}", LONG)}))
               for k in ("a", "b")]
    for t in threads:
        t.start()
    tok = token(s, "ab")
    s.wait_for(lambda: running(stay, tok) and running(leave, tok), 30, "a long request to run on each group")
    s.kubectl("scale", "inferencedeployment", "ab", "--replicas", "1")
    st = wait_status(s, "ab", done("ScaleDown", 1), "ab scaled down by abort")
    for t in threads:
        t.join(120)
    by_group = {a[2]: (k, a) for k, a in answers.items()}
    assert set(by_group) == {"0", "1"}, answers
    k, (code, body, _) = by_group["1"]  # the group that left
    assert code == 200 and body["finish_reason"] == "aborted" and len(body["token_ids"]) < LONG
    assert body["token_ids"] == oracle(f"long {k}", LONG)[:len(body["token_ids"])]  # what it had was right
    k, (code, body, _) = by_group["0"]
    assert code == 200 and body["finish_reason"] == "length" and body["token_ids"] == oracle(f"long {k}", LONG)
    assert "1 requests aborted" in st["elastic"]["lastResult"]
    assert_serves_like_the_oracle(st)
    delete(s, "ab")


def test_a_drain_that_times_out_cancels_the_scale_down(session: LocalSession) -> None:
    s = session
    apply(s, manifest("dt", elastic={"scaleDown": {"mode": "drain", "drainTimeoutSeconds": 1}}))
    st = wait_available(s, "dt", dpa=2)
    world, leave = st["worldGeneration"], pod_url(s, "dt-1")
    answer: dict[str, Any] = {}
    t = threading.Thread(target=lambda: answer.update(r=post(leave, {"prompt": "still running", "max_tokens": LONG})))
    t.start()
    s.wait_for(lambda: running(leave, token(s, "dt")), 30, "the long request to run")
    s.kubectl("scale", "inferencedeployment", "dt", "--replicas", "1")
    st = wait_status(s, "dt", lambda st: (st.get("elastic") or {}).get("lastResult", "").startswith("cancelled"),
                     "the scale-down to be cancelled")
    t.join(120)
    assert answer["r"][0] == 200 and answer["r"][1]["token_ids"] == oracle("still running", LONG)
    st = wait_status(s, "dt", available, "dt serving at its old size")
    assert st["dpa"] == 2 and st["worldGeneration"] == world and len(pods(s, "dt")) == 2
    progressing = next(c for c in st["conditions"] if c["type"] == "Progressing")
    assert progressing["reason"] == "ScaleDownCancelled" and "drain timed out" in progressing["message"]
    assert "ScaleDownCancelled" in [e["reason"] for e in events(s, "dt")]
    code, body = post(leave, {"prompt": "admitting again", "max_tokens": 6})
    assert code == 200 and body["token_ids"] == oracle("admitting again", 6)
    delete(s, "dt")


def explicit(lost: list[Any], dead_group: str, dead_url: str) -> bool:
    """Only requests on the group that lost a rank fail, each with an explicit error naming the loss (never wrong
    tokens): the router's 502 for a pod that went away with a request, or the group's own 500."""
    return all(code in (500, 502) and "lost:" in str(body.get("error", "")) and body.get("code") == "request_lost"
               and (group == dead_group or dead_url in str(body.get("error", "")))
               for _prompt, code, body, group in lost)


class LongRequest:
    """One long completion on a surviving pod, sent before the failure: it must finish in the new world."""

    def __init__(self, url: str, prompt: str) -> None:
        self.url, self.prompt, self.answer = url, prompt, {}
        self.thread = threading.Thread(target=lambda: self.answer.update(
            r=post(url, {"prompt": prompt, "max_tokens": LONG}, timeout=240)), daemon=True)

    def __enter__(self) -> LongRequest:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(240)

    def assert_like_the_oracle(self) -> None:
        self.thread.join(240)
        code, body = self.answer["r"]
        assert code == 200 and body["token_ids"] == oracle(self.prompt, LONG), (code, body)


def test_a_killed_rank_is_served_around_by_the_survivors_then_its_pod_rejoins_under_traffic(
        session: LocalSession) -> None:
    s = session
    apply(s, manifest("kr"))
    st = wait_available(s, "kr", dpa=2)
    world, before = st["worldGeneration"], uids(s, "kr")
    ip = s.get("pod", "kr-1")["status"]["podIP"]
    dead_url = f"http://{ip}:8000"
    assert dead_url in st["endpoints"]
    with AgentClient(f"{ip}:50051", agent_auth(s, "kr")) as c:
        pid = c.health().ranks[0].pid
    with Traffic(s, "kr") as traffic, LongRequest(pod_url(s, "kr-0"), "long, on the group that survives") as kept:
        s.wait_for(lambda: traffic.ok >= 3 and running(kept.url, token(s, "kr")) > 0, 60, "traffic to flow")
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        # a request sent after the kill is answered (like the oracle) by the surviving group: taken by the old
        # world before the loss was seen, or by the survivors' world (dpa 1), or, when the crashed rank restarted
        # fast enough to rejoin at once, by the restored one (the deleted-pod test, where a replacement pod takes
        # seconds, asserts the survivors' world itself answers)
        s.wait_for(lambda: any(sent > killed for sent, _group, _world in traffic.answered), 60,
                   "an answer to a request sent after the kill")
        st = wait_status(s, "kr", done("ScaleUp", 2), "kr back at dpa 2")
        kept.assert_like_the_oracle()  # held through the recovery with its KV cache
        served = traffic.ok
        s.wait_for(lambda: traffic.ok >= served + 3, 60, "traffic to flow again")
    after = [(group, gen) for sent, group, gen in traffic.answered if sent > killed]
    assert any(group == "0" for group, _gen in after), after
    assert st["worldGeneration"] == world + 2  # the survivors' world (dpa 1), then the restored one (dpa 2)
    assert any(gen == world + 2 for _sent, _group, gen in traffic.answered)
    # no pod replaced: the crashed rank's pod was kept out of the survivors' world while its agent restarted the
    # rank, and rejoined in the scale-up (no pod started cold)
    assert uids(s, "kr") == before
    recovered = next(e["message"] for e in events(s, "kr") if e["reason"] == "Recovered")
    assert "recovered dpa 2 -> 1" in recovered and "without pod(s) [1] (a crashed rank, restarting in place" in (
        recovered), recovered
    scaled = [e["message"] for e in events(s, "kr") if e["reason"] == "ScaledUp"]
    assert len(scaled) == 1 and "pod(s) [1] rejoined (no new pod)" in scaled[0], scaled
    assert s.get("pod", "kr-1")["metadata"]["labels"]["shardwise.io/role"] == "leader"
    assert not traffic.wrong and explicit(traffic.lost, "1", dead_url), traffic.report()
    assert_serves_like_the_oracle(st, "after a rank died")
    delete(s, "kr")


def test_a_survivor_stuck_in_the_broken_world_is_restarted_and_the_recovery_completes(session: LocalSession) -> None:
    # a surviving rank that never leaves the broken world (here frozen; on a real machine blocked in a collective
    # that a lost peer never completes) held the recovery in Standby: until the collective's 120 s timeout, or for
    # good. The operator restarts it after SURVIVOR_STUCK_S and the survivors' world forms and serves.
    s = session
    apply(s, manifest("su"))
    st = wait_available(s, "su", dpa=2)
    world, auth = st["worldGeneration"], agent_auth(s, "su")
    pids = {}
    for name in ("su-0", "su-1"):
        with AgentClient(f"{s.get('pod', name)['status']['podIP']}:50051", auth) as c:
            pids[name] = [r.pid for r in c.health().ranks]
    frozen = pids["su-0"][1]
    os.kill(frozen, signal.SIGSTOP)  # pod 0's second rank: it can never stand by on its own
    try:
        os.kill(pids["su-1"][0], signal.SIGKILL)  # the loss: pod 1's group cannot serve
        st = wait_status(s, "su", lambda st: done("ScaleUp", 2)(st) and st["worldGeneration"] >= world + 2,
                         "su recovered and back at dpa 2", timeout=150)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGCONT)
    said = [e["message"] for e in events(s, "su") if e["reason"] == "SurvivorsRestarted"]
    assert said and re.search(r"rank\(s\) \[(0, )?1\] of pod\(s\) \[0\] still in broken world", said[0]), said
    recovered = next(e["message"] for e in events(s, "su") if e["reason"] == "Recovered")
    assert "recovered dpa 2 -> 1" in recovered, recovered
    assert_serves_like_the_oracle(st, "after a survivor was stuck")
    delete(s, "su")


def test_a_deleted_pod_is_recovered_then_restored_under_traffic(session: LocalSession) -> None:
    s = session
    apply(s, manifest("dp"))
    st = wait_available(s, "dp", dpa=2)
    world = st["worldGeneration"]
    dead_url = f"http://{s.get('pod', 'dp-1')['status']['podIP']}:8000"
    assert dead_url in st["endpoints"]
    with Traffic(s, "dp") as traffic, LongRequest(pod_url(s, "dp-0"), "long, on the pod that stays") as kept:
        s.wait_for(lambda: traffic.ok >= 3 and running(kept.url, token(s, "dp")) > 0, 60, "traffic to flow")
        s.kubectl("delete", "pod", "dp-1", "--wait=false")
        deleted = time.monotonic()
        # survivors first: while the replacement pod starts, the surviving group's world (dpa 1) takes requests
        # sent after the deletion and answers them like the oracle
        s.wait_for(lambda: any(sent > deleted and gen == world + 1 for sent, _g, gen in traffic.answered), 60,
                   "the survivors' world to answer a request sent after the deletion")
        st = wait_status(s, "dp", done("ScaleUp", 2), "dp recovered and back at dpa 2")
        kept.assert_like_the_oracle()
        served = traffic.ok
        s.wait_for(lambda: traffic.ok >= served + 3, 60, "traffic to flow again")
    assert st["worldGeneration"] == world + 2  # the survivors' world (dpa 1), then the restored one (dpa 2)
    reasons = [e["reason"] for e in events(s, "dp")]
    assert "Recovered" in reasons and "ScaledUp" in reasons
    recovered = next(e["message"] for e in events(s, "dp") if e["reason"] == "Recovered")
    # the survivors keep their experts; those only pod 1 held (4 of tiny-moe's 16, in each of its 4 MoE
    # layers, under the round-robin map of 24 slots) load from the weight files
    assert "16 experts no staying rank held loaded from the weight files" in recovered, recovered
    assert not traffic.wrong and explicit(traffic.lost, "1", dead_url), traffic.report()
    assert_serves_like_the_oracle(st, "after a pod was lost")
    delete(s, "dp")


def test_a_standby_pod_takes_a_deleted_pods_group_without_a_pod_start_and_another_stands_by(
        session: LocalSession) -> None:
    s = session
    apply(s, manifest("sb", elastic={"standbyPods": 1}))
    st = wait_status(s, "sb", lambda st: available(st) and bool(st.get("standby")), "sb serving beside a standby pod")
    [index] = st["standby"]
    standby = s.get("pod", f"sb-{index}")
    assert standby["metadata"]["labels"]["shardwise.io/role"] == "standby"
    assert sorted(p["index"] for p in st["pods"]) == [0, 1] and index not in (0, 1)  # out of the world
    world = st["worldGeneration"]
    s.kubectl("delete", "pod", "sb-1", "--wait=false")
    # survivors first, then the scale-up back to dpa 2 configures the standby pod instead of creating one
    st = wait_status(s, "sb", lambda st: done("ScaleUp", 2)(st) and st["worldGeneration"] == world + 2,
                     "sb back at dpa 2")
    assert sorted(p["index"] for p in st["pods"]) == [0, index]
    took = s.get("pod", f"sb-{index}")
    assert took["metadata"]["uid"] == standby["metadata"]["uid"]  # the same pod: no pod was started for it
    assert took["metadata"]["labels"]["shardwise.io/role"] == "leader"  # it leads the group it took
    scaled = next(e["message"] for e in events(s, "sb") if e["reason"] == "ScaledUp")
    assert f"standby pod(s) [{index}] joined" in scaled, scaled
    assert_serves_like_the_oracle(st, "after a standby pod took a lost pod's group")
    # and a new standby pod takes its place beside the world
    st = wait_status(s, "sb", lambda st: bool(st.get("standby")) and st["standby"] != [index], "a new standby pod")
    assert st["standby"][0] not in {p["index"] for p in st["pods"]}  # (the deleted pod's index, once it is free)
    delete(s, "sb")


def test_a_hung_agent_is_found_by_its_silence_and_its_pod_recovered_like_a_lost_one(session: LocalSession) -> None:
    s = session
    apply(s, manifest("hung"))
    st = wait_available(s, "hung", dpa=2)
    world, before = st["worldGeneration"], uids(s, "hung")
    pid = s.agent_pid("hung", 1)
    os.kill(pid, signal.SIGSTOP)  # answers nothing from now on: no HTTP, no gRPC, no probe
    try:
        st = wait_status(s, "hung", done("ScaleUp", 2), "hung recovered and back at dpa 2")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # (killed by then; never leave a stopped process behind)
    assert st["worldGeneration"] == world + 2  # the survivors' world (dpa 1), then the restored one (dpa 2)
    after = uids(s, "hung")
    assert after["hung-0"] == before["hung-0"] and len(after) == 2 and before["hung-1"] not in after.values()
    # found by the operator (no health for three heartbeats, the pod not ready), before its liveness probe
    hung = [e["message"] for e in events(s, "hung") if e["reason"] == "AgentsHung"]
    assert len(hung) == 1 and "no health from the agents of hung-1 for " in hung[0], hung
    recovered = next(e["message"] for e in events(s, "hung") if e["reason"] == "Recovered")
    assert "recovered dpa 2 -> 1" in recovered and ("after losing pod(s) [1]" in recovered
                                                   or "without pod(s) [1]" in recovered), recovered
    assert_serves_like_the_oracle(st, "after an agent hung")
    delete(s, "hung")


def test_the_api_server_down_for_15_s_during_a_scale_up_loses_no_request_and_the_scale_up_completes(
        session: LocalSession) -> None:
    s = session
    apply(s, manifest("outage"))
    st = wait_available(s, "outage", dpa=2)
    world = st["worldGeneration"]
    with Traffic(s, "outage") as traffic:
        s.wait_for(lambda: traffic.ok >= 3, 60, "traffic to flow")
        s.kubectl("scale", "inferencedeployment", "outage", "--replicas", "3")
        wait_status(s, "outage", lambda st: (st.get("elastic") or {}).get("operation") == "ScaleUp",
                    "the scale-up started")
        before = traffic.ok
        s.api_outage(15)  # every API call fails meanwhile: the operator's, its cache's watches, the nodes'
        during = traffic.ok - before
        st = wait_status(s, "outage", done("ScaleUp", 3), "the scale-up completed after the outage")
        served = traffic.ok
        s.wait_for(lambda: traffic.ok >= served + 3, 60, "traffic to flow at dpa 3")
    assert during > 0  # the data plane served while the control plane was down
    assert st["worldGeneration"] == world + 1 and len(st["endpoints"]) == 3
    assert not traffic.wrong and not traffic.lost, traffic.report()
    assert_serves_like_the_oracle(st, "after the API server's outage")
    delete(s, "outage")


@pytest.mark.parametrize("first", ["api down", "rank killed", "operator restarted"])
def test_a_rank_killed_around_an_api_server_outage_is_served_around_during_it_and_restored_after(
        session: LocalSession, first: str) -> None:
    """Killed while the API is down, or just before it goes down (the recovery has begun, and every write of it
    fails for 12 s), or before it and the operator killed during the outage too (what it decided in memory is
    lost; the agents' worlds are not). Survivors first needs no API server: the surviving group's world forms and
    serves during the outage; the scale-up back to two groups waits for the API."""
    s = session
    apply(s, manifest("ko"))
    st = wait_available(s, "ko", dpa=2)
    world, before = st["worldGeneration"], uids(s, "ko")
    address, auth = f"{s.get('pod', 'ko-1')['status']['podIP']}:50051", agent_auth(s, "ko")
    with AgentClient(address, auth) as c, Traffic(s, "ko") as traffic:
        pid = c.health().ranks[0].pid
        s.wait_for(lambda: traffic.ok >= 3, 60, "traffic to flow")
        if first != "api down":
            os.kill(pid, signal.SIGKILL)
        s.api_down()
        down = time.monotonic()
        try:
            if first == "api down":
                os.kill(pid, signal.SIGKILL)
            # answered by the survivors' world, or by the world the restarted rank rejoined right after it (the
            # rejoin needs no API server either): either way, without the API and without the lost rank's old world
            s.wait_for(lambda: any(sent > down and gen > world for sent, _g, gen in traffic.answered), 60,
                       "the survivors' world to answer while the API server is down")
            # the agent restarts its rank in place meanwhile: it stands by for the scale-up that takes it back
            s.wait_for(lambda: standing_by(c), 90, "pod 1's restarted rank to stand by")
            if first == "operator restarted":
                s.kill_operator(signal.SIGKILL)
            time.sleep(max(0.0, 12 - (time.monotonic() - down)))  # the outage lasts 12 s (the fault, not a wait)
        finally:
            s.api_up()
        if first == "operator restarted":
            s.start_operator()
        st = wait_available(s, "ko", world_above=world + 1, dpa=2)
        served = traffic.ok
        s.wait_for(lambda: traffic.ok >= served + 3, 60, "traffic to flow again")
    assert uids(s, "ko") == before  # the crashed rank's pod rejoined: no pod replaced
    assert not traffic.wrong, traffic.report()
    if first == "operator restarted":  # the status held the recovery (Standby) or nothing of it (adopted)
        def recorded(r: dict[str, str]) -> bool:
            return ("Recovered" in r or "WorldAdopted" in r) and "ScaledUp" in r
    else:  # the events of the outage, sent once the API server was back
        def recorded(r: dict[str, str]) -> bool:
            return "recovered dpa 2 -> 1" in r.get("Recovered", "") and "ScaledUp" in r

    def reasons() -> dict[str, str]:
        return {e["reason"]: e["message"] for e in events(s, "ko")}
    # events are posted after the writes they record (as a real operator's are): waited for, not read once
    with contextlib.suppress(AssertionError):
        s.wait_for(lambda: recorded(reasons()), 30, "the outage's events")
    assert recorded(reasons()), reasons()
    assert_serves_like_the_oracle(st, "after a rank died while the API server was down")
    delete(s, "ko")


def test_a_change_during_an_operation_waits_for_it_and_is_reported(session: LocalSession) -> None:
    s = session
    apply(s, manifest("qu"))
    wait_available(s, "qu", dpa=2)
    s.kubectl("scale", "inferencedeployment", "qu", "--replicas", "3")
    wait_status(s, "qu", lambda st: (st.get("elastic") or {}).get("phase") == "Provisioning", "the scale-up", 30)
    s.kubectl("scale", "inferencedeployment", "qu", "--replicas", "2")
    queued = s.wait_for(lambda: [e for e in events(s, "qu") if e["reason"] == "ScalingQueued"], 30, "the report")
    assert "dpa 2 requested during ScaleUp 2 -> 3" in queued[0]["message"]
    st = wait_status(s, "qu", done("ScaleDown", 2), "the queued scale-down after the scale-up")
    assert "ScaledUp" in [e["reason"] for e in events(s, "qu")]
    assert st["elastic"]["fromDpa"] == 3  # the scale-down started from the finished scale-up: one after the other
    assert_serves_like_the_oracle(st)
    delete(s, "qu")
