"""What a node reports and runs, as pure functions: a pod's phase and conditions (podstatus.py), back-off, the
container's environment and command line (podenv.py) and pod IPs (nodes.py)."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from shardwise.devcluster.nodes import next_pod_ip
from shardwise.devcluster.podenv import EnvError, command_line, container_env, expand, secret_data
from shardwise.devcluster.podstatus import Backoff, ContainerView, exit_code_of, pod_conditions, pod_phase

WAITING = ContainerView("c")
RUNNING = ContainerView("c", state={"running": {"startedAt": "t"}}, ready=True)
BACKING_OFF = ContainerView("c", state={"waiting": {"reason": "CrashLoopBackOff"}},
                            last_state={"terminated": {"exitCode": 1}})


def done(code: int) -> ContainerView:
    return ContainerView("c", state={"terminated": {"exitCode": code}})


@pytest.mark.parametrize(("case", "policy", "init", "main", "terminating", "phase"), [
    ("not started yet", "Always", [], [WAITING], False, "Pending"),
    ("an init container still runs", "Always", [WAITING], [WAITING], False, "Pending"),
    ("an init container failed for good", "Never", [done(1)], [WAITING], False, "Failed"),
    ("running", "Always", [done(0)], [RUNNING], False, "Running"),
    ("restarting after a crash", "Always", [], [BACKING_OFF], False, "Running"),
    ("all exited 0 under OnFailure", "OnFailure", [], [done(0), done(0)], False, "Succeeded"),
    ("one failed under Never", "Never", [], [done(0), done(2)], False, "Failed"),
    ("one still runs", "Never", [], [done(2), RUNNING], False, "Running"),
    ("stopped on deletion", "Always", [], [done(143)], True, "Failed"),
    ("stopped on deletion cleanly", "Always", [], [done(0)], True, "Succeeded"),
])
def test_phase(case: str, policy: str, init: list[ContainerView], main: list[ContainerView], terminating: bool,
               phase: str) -> None:
    assert pod_phase(policy, init, main, terminating=terminating) == phase, case


def test_conditions_keep_others_and_their_transition_times() -> None:
    scheduled = {"type": "PodScheduled", "status": "True", "lastTransitionTime": "t0"}
    pod = {"status": {"conditions": [scheduled, {"type": "Ready", "status": "False", "lastTransitionTime": "t1"}]}}
    unready = pod_conditions(pod, [], [WAITING], "Pending", "t2")
    by_type = {c["type"]: c for c in unready}
    assert by_type["PodScheduled"] == scheduled
    assert by_type["Ready"]["lastTransitionTime"] == "t1"
    assert by_type["ContainersReady"]["message"] == "containers with unready status: [c]"
    ready = {c["type"]: c for c in pod_conditions(pod, [], [RUNNING], "Running", "t3")}
    assert (ready["Ready"]["status"], ready["Ready"]["lastTransitionTime"]) == ("True", "t3")
    assert "message" not in ready["Ready"]


def test_a_readiness_gate_holds_a_ready_pod_back() -> None:
    pod = {"spec": {"readinessGates": [{"conditionType": "example.com/warm"}]}, "status": {}}
    ready = {c["type"]: c for c in pod_conditions(pod, [], [RUNNING], "Running", "t")}
    assert (ready["ContainersReady"]["status"], ready["Ready"]["status"]) == ("True", "False")
    assert ready["Ready"]["reason"] == "ReadinessGatesNotReady"


def test_backoff_doubles_up_to_its_cap() -> None:
    assert [Backoff().delay(step) for step in range(7)] == [10, 20, 40, 80, 160, 300, 300]
    assert Backoff(base=0.5, cap=1.0).delay(5) == 1.0


@pytest.mark.parametrize(("returncode", "code"), [(0, 0), (3, 3), (-15, 143), (-9, 137)])
def test_a_signal_reads_as_128_plus_its_number(returncode: int, code: int) -> None:
    assert exit_code_of(returncode) == code


POD: dict[str, Any] = {
    "metadata": {"name": "web", "namespace": "serving", "uid": "u1", "labels": {"app": "x"},
                 "annotations": {"team": "infra"}},
    "spec": {"nodeName": "node-0", "containers": [{"name": "main", "resources": {"limits": {"memory": "1Gi"}}}]},
}


def env_of(container: dict[str, Any], **sources: Any) -> dict[str, str]:
    return container_env(POD, container, pod_ip="127.0.1.7", host_ip="127.0.0.1",
                         configmaps=sources.get("configmaps", {}), secrets=sources.get("secrets", {}),
                         node_allocatable={"cpu": "8", "memory": "32Gi"})


def test_the_downward_api_fills_fields_labels_and_resources() -> None:
    paths = {"NAME": "metadata.name", "NS": "metadata.namespace", "NODE": "spec.nodeName", "IP": "status.podIP",
             "APP": "metadata.labels['app']", "TEAM": "metadata.annotations['team']"}
    env = [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": v}}} for k, v in paths.items()]
    env += [{"name": "MEM_MI", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}},
            {"name": "CPUS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}]
    assert env_of({"name": "main", "env": env}) == {
        "NAME": "web", "NS": "serving", "NODE": "node-0", "IP": "127.0.1.7", "APP": "x", "TEAM": "infra",
        "MEM_MI": "1024", "CPUS": "8"}


def test_configmaps_and_secrets_feed_the_environment() -> None:
    container = {"name": "main", "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}], "env": [
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "MAYBE", "valueFrom": {"configMapKeyRef": {"name": "absent", "key": "k", "optional": True}}}]}
    env = env_of(container, configmaps={"cfg": {"mode": "fast"}, "absent": None}, secrets={"creds": {"token": "s3"}})
    assert env == {"CFG_mode": "fast", "TOKEN": "s3"}
    assert secret_data({"data": {"token": base64.b64encode(b"s3").decode()}}) == {"token": "s3"}


def test_a_missing_configmap_fails_the_container_start() -> None:
    container = {"name": "main", "env": [{"name": "X", "valueFrom": {"configMapKeyRef": {"name": "gone", "key": "k"}}}]}
    with pytest.raises(EnvError, match="configmap 'gone' not found"):
        env_of(container, configmaps={"gone": None})


def test_references_expand_in_values_and_command_lines() -> None:
    env = env_of({"name": "main", "env": [{"name": "PORT", "value": "8080"},
                                          {"name": "ADDR", "value": "$(POD_IP):$(PORT)"}]})
    assert env["ADDR"] == "$(POD_IP):8080"  # POD_IP comes from the node, after the spec's variables
    full = {**env, "POD_IP": "127.0.1.7"}
    argv = command_line({"command": ["serve"], "args": ["--bind", "$(POD_IP):$(PORT)", "$$(PORT)", "$(NOPE)"]}, full)
    assert argv == ["serve", "--bind", "127.0.1.7:8080", "$(PORT)", "$(NOPE)"]
    assert expand("cost: $$5", {}) == "cost: $5"


def test_a_container_without_a_command_cannot_start() -> None:
    with pytest.raises(EnvError, match="no command"):
        command_line({"name": "main", "image": "nginx"}, {})


def test_pod_ips_are_handed_out_in_turn_and_never_twice() -> None:
    assert next_pod_ip("127.0.1.0/24", set()) == "127.0.1.1"
    assert next_pod_ip("127.0.1.0/24", {"127.0.1.1", "127.0.1.2"}) == "127.0.1.3"
    assert next_pod_ip("127.0.1.0/24", set(), after="127.0.1.5") == "127.0.1.6"
    assert next_pod_ip("127.0.1.0/30", {"127.0.1.2"}, after="127.0.1.2") == "127.0.1.1"
    with pytest.raises(RuntimeError, match="no free pod IP"):
        next_pod_ip("127.0.1.0/30", {"127.0.1.1", "127.0.1.2"})
