"""`shardwise dev install-chart` without a cluster: what it renders (Helm's engine, offline) and in what order, the
values it gives the local cluster and how the user's `--set` override them, and what it says when it cannot run.
The install itself, with the operator running in-cluster, is tests/operator/test_chart_in_cluster.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwise import cli

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is in the dev extra: run `make install`")

from shardwise.devcluster import chart  # noqa: E402


def rendered(*sets: str, release: str = "shardwise", namespace: str = "shardwise-system") -> list[dict[str, object]]:
    return chart.render(chart.CHART, chart.values(sets), release=release, namespace=namespace)[1]


def test_the_local_values_turn_the_webhook_off_keep_network_policies_and_draw_free_ports() -> None:
    values = chart.values(())
    assert values["webhook"] == {"enabled": False} and values["networkPolicy"] == {"enabled": True}
    ports = values["ports"]
    assert len({ports["health"], ports["metrics"], ports["webhook"]}) == 3 and all(p > 0 for p in ports.values())
    objects = chart.render(chart.CHART, values, release="shardwise", namespace="shardwise-system")[1]
    kinds = [o["kind"] for o in objects]
    assert "ValidatingWebhookConfiguration" not in kinds and "Secret" not in kinds  # no webhook, no certificate
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]  # type: ignore[index]
    assert "--webhook-port" not in command and "--network-policy-namespace" in command
    assert command[command.index("--health-port") + 1] == str(ports["health"])


def test_objects_come_in_helms_install_order_annotated_with_the_release() -> None:
    objects = rendered(release="sw", namespace="team")
    kinds = [o["kind"] for o in objects]
    assert kinds == sorted(kinds, key=chart.INSTALL_ORDER.index)
    assert kinds.index("ServiceAccount") < kinds.index("ClusterRoleBinding") < kinds.index("Deployment")
    for obj in objects:
        annotations = obj["metadata"]["annotations"]  # type: ignore[index]
        assert annotations["meta.helm.sh/release-name"] == "sw", obj
        assert annotations["meta.helm.sh/release-namespace"] == "team", obj
    crds = chart.render(chart.CHART, chart.values(()), release="sw", namespace="team")[0]
    assert [crd["metadata"]["name"] for crd in crds] == ["inferencedeployments.shardwise.io"]


def test_the_users_set_wins_over_the_local_values_in_helms_syntax() -> None:
    objects = rendered("ports.health=18080", "replicas=2", "webhook.enabled=true", "prometheusAllow={http://p:9090}")
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 2  # type: ignore[index]
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]  # type: ignore[index]
    assert command[command.index("--health-port") + 1] == "18080"
    assert command[command.index("--prometheus-allow") + 1] == "http://p:9090"
    assert "ValidatingWebhookConfiguration" in [o["kind"] for o in objects]


def test_a_value_the_charts_schema_refuses_is_an_error_naming_it() -> None:
    with pytest.raises(chart.ChartError, match="replicas"):
        rendered("replicas=many")


def test_without_a_cluster_the_command_says_to_start_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["dev", "install-chart", "--state-dir", str(tmp_path / "dev")])
    assert exited.value.code == cli.EXIT_USAGE
    assert capsys.readouterr().err == (f"error: no kubeconfig at {tmp_path / 'dev' / 'kubeconfig'}: start the local "
                                       "cluster with `shardwise dev up` (or name one with --kubeconfig)\n")
