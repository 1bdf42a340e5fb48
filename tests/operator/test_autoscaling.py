"""The autoscaler end to end: a real Prometheus scrapes the agents' metrics, a load ramp makes the operator
scale dpa up in place, and once the load stops and the window and cooldown pass, down again; with Prometheus
down, an idle deployment keeps its size and says why."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kopf")
pytest.importorskip("kmock")

from shardwise.devcluster.prometheus import PrometheusMissing, find_binary
from shardwise.devcluster.session import LocalSession

from tests.operator.common import apply, available, delete, events, local_session, manifest, oracle, post, wait_status

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    try:
        find_binary()
    except PrometheusMissing as e:
        pytest.skip(str(e))
    yield from local_session(tmp_path_factory, "autoscaling", prometheus=True,
                             operator_env={"SHARDWISE_EPLB_CHECK_SECONDS": "3600"})


def test_a_load_ramp_scales_up_and_a_lull_scales_back_down(session: LocalSession) -> None:
    s = session
    assert s.prometheus is not None
    autoscaling = {"enabled": True, "prometheusUrl": s.prometheus.url, "targetPerDpa": 2.0,
                   "stabilizationWindowSeconds": 5, "cooldownSeconds": 5, "intervalSeconds": 1}
    apply(s, manifest("auto", dpa=1, elastic={"minDpa": 1, "maxDpa": 2}, autoscaling=autoscaling))
    st = wait_status(s, "auto", lambda st: available(st) and st.get("dpa") == 1, "auto Available at dpa 1")
    url = st["endpoints"][0]
    stop = threading.Event()
    answers: list[Any] = []

    def load(k: int) -> None:  # 6 clients back to back: about 6 requests running or queued, 3 per group wanted
        i = 0
        while not stop.is_set():
            prompt = f"ramp {k} {i}"
            code, body = post(url, {"prompt": prompt, "max_tokens": 64})
            answers.append((code, body.get("token_ids") == oracle(prompt, 64) if code == 200 else body))
            i += 1

    clients = [threading.Thread(target=load, args=(k,), daemon=True) for k in range(6)]
    for t in clients:
        t.start()
    try:
        st = wait_status(s, "auto", lambda st: available(st) and st.get("dpa") == 2, "a scale-up to dpa 2",
                         timeout=180)
    finally:
        stop.set()
        for t in clients:
            t.join(120)
    up = [e for e in events(s, "auto") if e["reason"] == "AutoscaleUp"]
    assert up and "dpa 1 -> 2" in up[0]["message"] and "load" in up[0]["message"], up
    assert st["elastic"]["operation"] == "ScaleUp"
    assert answers and all(a == (200, True) for a in answers), [a for a in answers if a != (200, True)][:3]
    st = wait_status(s, "auto", lambda st: available(st) and st.get("dpa") == 1, "a scale-down after the lull",
                     timeout=180)
    down = [e for e in events(s, "auto") if e["reason"] == "AutoscaleDown"]
    assert down and "dpa 2 -> 1" in down[0]["message"], down
    assert st["autoscaling"]["lastValue"] < 2.0 and not st["autoscaling"].get("lastError")
    delete(s, "auto")


def test_prometheus_down_holds_an_idle_deployment_at_its_size_and_says_so_then_scaling_resumes(
        session: LocalSession) -> None:
    """No metrics is unknown, not zero load: an idle deployment whose Prometheus is down keeps its size (it would
    scale down to minDpa if missing series read as 0), with the error in status and an event; once Prometheus is
    back, the same idle deployment scales down."""
    s = session
    prometheus = s.prometheus
    assert prometheus is not None
    autoscaling = {"enabled": True, "prometheusUrl": prometheus.url, "targetPerDpa": 2.0,
                   "stabilizationWindowSeconds": 3, "cooldownSeconds": 3, "intervalSeconds": 1}
    prometheus.stop()
    try:
        apply(s, manifest("blind", dpa=2, elastic={"minDpa": 1, "maxDpa": 2}, autoscaling=autoscaling))
        wait_status(s, "blind", lambda st: available(st) and st.get("dpa") == 2, "blind Available at dpa 2")
        checks: set[str] = set()

        def failed_checks(st: dict[str, Any]) -> bool:
            mine = st.get("autoscaling") or {}
            if mine.get("lastError"):
                checks.add(str(mine.get("lastCheck")))
            return len(checks) >= 8  # well past the window and the cooldown that a scale-down would wait out

        st = wait_status(s, "blind", failed_checks, "eight checks that could not read Prometheus", timeout=120)
        assert "Prometheus" in st["autoscaling"]["lastError"] or prometheus.url in st["autoscaling"]["lastError"], (
            st["autoscaling"])
        assert st["dpa"] == 2 and s.get("inferencedeployment", "blind")["spec"]["parallelism"]["dpa"] == 2
        said = [e["message"] for e in events(s, "blind") if e["reason"] == "AutoscalingError"]
        assert said and "keeping dpa 2" in said[0], said
        assert not [e for e in events(s, "blind") if e["reason"] == "AutoscaleDown"]
    finally:
        if prometheus.proc is None or prometheus.proc.poll() is not None:
            prometheus.start()
    st = wait_status(s, "blind", lambda st: available(st) and st.get("dpa") == 1,
                     "a scale-down once Prometheus is back", timeout=180)
    assert not st["autoscaling"].get("lastError"), st["autoscaling"]
    assert [e for e in events(s, "blind") if e["reason"] == "AutoscaleDown"]
    delete(s, "blind")


DASHBOARD = Path(__file__).resolve().parents[2] / "charts" / "shardwise" / "dashboards" / "shardwise-deployment.json"


def panel_queries(deployment: str, namespace: str) -> dict[str, str]:
    """Every query of the shipped dashboard, its variables set as Grafana sets them for one deployment."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = {}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$deployment", deployment).replace("$namespace", namespace)
            out[f"{panel['title']} [{target['refId']}]"] = expr.replace("$__rate_interval", "1m")
    return out


def test_every_panel_of_the_dashboard_returns_data_for_a_running_deployment(session: LocalSession) -> None:
    s = session
    assert s.prometheus is not None
    apply(s, manifest("watched"))
    st = wait_status(s, "watched", available, "watched Available")
    for url in [*st["endpoints"], st["url"]]:  # each DPA group, and the router in front of them
        for i in range(3):
            code, body = post(url, {"prompt": f"dashboard {i}", "max_tokens": 8})
            assert code == 200 and body["token_ids"] == oracle(f"dashboard {i}", 8), body
    queries = panel_queries("watched", "default")
    assert len(queries) >= 13

    prometheus = s.prometheus

    def missing() -> list[str]:
        return [title for title, expr in queries.items() if not prometheus.query(expr)]

    try:
        s.wait_for(lambda: not missing(), 120, "every dashboard panel to return data")
    except AssertionError:
        raise AssertionError(f"panels without data: {missing()}") from None
    # the series are the deployment's own: another name selects nothing
    assert not prometheus.query(panel_queries("nobody", "default")["Queue depth per DPA group [A]"])
    delete(s, "watched")
