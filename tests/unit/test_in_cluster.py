"""What a real cluster does to the operator's process that a lenient local one did not: service-link variables in
every container, the in-cluster client's lower-case `bearer` token, a webhook certificate rotated under a running
operator, and kopf's watching dying while the process lives on."""

from __future__ import annotations

import json
import logging
import os
import ssl
import urllib.request
from pathlib import Path
from typing import Any

import click
import kopf
import pytest
from click.testing import CliRunner
from kubernetes import client
from shardwise.operator import certs, webhook
from shardwise.operator.handlers import Settings
from shardwise.operator.kube import bearer_token
from shardwise.operator.main import Watchdog, serve_health

from shardwise import cli, envvars

LINK = "tcp://10.96.47.183:9090"


@pytest.mark.parametrize(("value", "link"), [
    ("tcp://10.96.47.183:9090", True), ("udp://10.0.0.1:53", True), ("TCP://[fd00::1]:80", True),
    ("9090", False), ("http://prometheus:9090", False), ("", False), ("tcp://host", False),
])
def test_a_service_links_value_is_told_from_a_setting(value: str, link: bool) -> None:
    assert envvars.is_service_link(value) is link


def _options(command: click.Command) -> list[click.Option]:
    found = [p for p in command.params if isinstance(p, click.Option)]
    for sub in getattr(command, "commands", {}).values():
        found += _options(sub)
    return found


def test_no_setting_takes_a_name_the_kubelet_makes_for_a_service() -> None:
    names = [name for option in _options(cli.cli) for name in ([option.envvar] if isinstance(option.envvar, str)
                                                              else option.envvar or [])]
    assert names and all(n.startswith("SHARDWISE_") for n in names)
    assert [n for n in names if envvars.is_link_name(n)] == []
    assert envvars.is_link_name("SHARDWISE_METRICS_SERVICE_HOST") and envvars.is_link_name("X_PORT_9090_TCP_ADDR")


def test_the_clis_options_keep_their_defaults_under_service_links() -> None:
    """A Service named shardwise-metrics (the chart's) or shardwise-http in the pod's namespace injects
    SHARDWISE_METRICS_PORT / SHARDWISE_HTTP_PORT = tcp://...; the router's settings are its own all the same."""
    seen: dict[str, Any] = {}

    @click.command()
    @click.option("--metrics-port", type=click.IntRange(min=0), default=9090, **cli._env("METRICS_PORT"))
    @click.option("--port", type=click.IntRange(min=0), default=8000, **cli._env("HTTP_PORT"))
    def probe(metrics_port: int, port: int) -> None:
        seen.update(metrics=metrics_port, http=port)

    env = {"SHARDWISE_METRICS_PORT": LINK, "SHARDWISE_HTTP_PORT": "tcp://10.96.0.9:80"}
    result = CliRunner().invoke(probe, [], env=env)
    assert result.exit_code == 0, result.output
    assert seen == {"metrics": 9090, "http": 8000}
    assert CliRunner().invoke(probe, [], env={"SHARDWISE_METRICS_PORT": "9191"}).exit_code == 0
    assert seen["metrics"] == 9191  # a real setting is still read


def test_the_operators_settings_from_the_environment_ignore_service_links(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDWISE_WEBHOOK_PORT", LINK)
    monkeypatch.setenv("SHARDWISE_GANG_TIMEOUT", "tcp://10.96.0.3:300")
    monkeypatch.setenv("SHARDWISE_AGENT_IMAGE", "shardwise:9")
    settings = Settings.from_env()
    assert settings.webhook_port == 0 and settings.options.gang_timeout_s == 300
    assert settings.options.build.image == "shardwise:9"


@pytest.mark.parametrize(("api_key", "prefix", "token"), [
    ({"authorization": "bearer abc.def"}, {}, "abc.def"),  # the in-cluster loader's form
    ({"authorization": "Bearer abc.def"}, {}, "abc.def"),  # a kubeconfig's
    ({"BearerToken": "abc.def"}, {"BearerToken": "Bearer"}, "abc.def"),
    ({}, {}, None),
])
def test_the_bearer_token_is_sent_once_without_its_scheme(api_key: dict[str, str], prefix: dict[str, str],
                                                           token: str | None) -> None:
    conf = client.Configuration()
    conf.api_key, conf.api_key_prefix = api_key, prefix
    assert bearer_token(conf) == token


def test_a_rotated_service_account_token_is_read_again(tmp_path: Path) -> None:
    """The in-cluster loader keeps a refresh hook that reads the token file again; bearer_token calls it."""
    from kubernetes.config.incluster_config import InClusterConfigLoader

    token, cert = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("first")
    cert.write_bytes(certs.issue("x")["ca.crt"])
    loader = InClusterConfigLoader(str(token), str(cert), environ={"KUBERNETES_SERVICE_HOST": "127.0.0.1",
                                                                   "KUBERNETES_SERVICE_PORT": "6443"},
                                   try_refresh_token=True)
    conf = client.Configuration()
    loader.load_and_set(conf)
    assert bearer_token(conf) == "first"
    token.write_text("rotated")
    loader.token_expires_at = loader.token_expires_at.replace(year=2000)  # the loader re-reads once a minute
    assert bearer_token(conf) == "rotated"


def _record(name: str, message: str, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, None) if exc is not None else None
    return logging.LogRecord(name, logging.ERROR, __file__, 1, message, (), exc_info)


def _login_failure() -> BaseException:
    try:
        try:
            raise RuntimeError("401 Unauthorized")
        except RuntimeError as e:
            raise kopf.LoginError("Ran out of valid credentials.") from e
    except kopf.LoginError as e:
        return e


@pytest.mark.parametrize(("record", "fatal"), [
    (_record("kopf._cogs.aiokits.aiotasks", "Watcher for inferencedeployments has failed: boom"), True),
    (_record("kopf.objects", "Request attempt failed", _login_failure()), True),
    (_record("kopf.objects", "Handler 'world' failed with an exception. Will retry.", ValueError("x")), False),
    (_record("shardwise.operator", "Watcher for x has failed: y"), False),
])
def test_the_watchdog_knows_a_dead_watch_from_a_failed_handler(record: logging.LogRecord, fatal: bool) -> None:
    assert Watchdog.fatal(record) is fatal


def test_health_fails_once_kopfs_watching_failed() -> None:
    dog = Watchdog()
    server = serve_health(0, dog)
    url = f"http://127.0.0.1:{server.server_address[1]}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            assert r.status == 200
        logger = logging.getLogger("kopf._cogs.aiokits.aiotasks")
        logger.addHandler(dog)
        try:
            logger.error("Watcher for inferencedeployments.v1alpha1.shardwise.io@none has failed: Ran out of valid "
                         "credentials.")
        finally:
            logger.removeHandler(dog)
        assert dog.failed.is_set()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=5)
        assert e.value.code == 503 and b"Ran out of valid credentials" in e.value.read()
    finally:
        server.shutdown()
        server.server_close()


def _install(folder: Path, files: dict[str, bytes]) -> None:
    """As the kubelet updates a Secret volume: the new files appear at once (renamed over the old ones)."""
    for key in ("tls.crt", "tls.key"):
        (folder / f".{key}.new").write_bytes(files[key])
        os.replace(folder / f".{key}.new", folder / key)


def _review(port: int, ca: bytes) -> dict[str, Any]:
    """A review over HTTPS trusting only `ca` (the caBundle); the certificate's name is not the point here."""
    context = ssl.create_default_context(cadata=ca.decode())
    context.check_hostname = False
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "1", "operation": "DELETE", "object": None}}
    req = urllib.request.Request(f"https://127.0.0.1:{port}/validate-inferencedeployment",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10, context=context) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def test_a_rotated_webhook_certificate_is_served_without_a_restart(tmp_path: Path) -> None:
    first, second = certs.issue("webhook-1"), certs.issue("webhook-2")
    _install(tmp_path, first)
    server = webhook.serve("127.0.0.1", 0, str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    port = server.server_address[1]
    try:
        assert _review(port, first["ca.crt"])["response"]["allowed"] is True
        _install(tmp_path, second)  # the Secret and the caBundle rotate
        assert _review(port, second["ca.crt"])["response"]["allowed"] is True
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            _review(port, first["ca.crt"])
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("current", "fields", "write"), [
    ({}, {"balanceCurrent": 1.2, "lastCheck": "balanced"}, True),
    ({"balanceCurrent": 1.2, "lastCheck": "balanced"}, {"balanceCurrent": 1.204, "lastCheck": "balanced"}, False),
    ({"balanceCurrent": 1.2, "lastCheck": "balanced"}, {"balanceCurrent": 1.25, "lastCheck": "balanced"}, True),
    ({"balanceCurrent": 1.2, "lastCheck": "balanced"}, {"balanceCurrent": 1.2, "lastCheck": "interval"}, True),
    ({"inProgress": True}, {"inProgress": None}, True),
    ({}, {"inProgress": None, "inProgressDeadline": None}, False),
    ({"lastValue": 3.0, "lastCheck": "2026-12-07T10:00:00Z", "desiredDpa": 2},
     {"lastValue": 3.0, "lastCheck": "2026-12-07T10:00:15Z", "desiredDpa": 2}, False),
    ({"lastValue": 3.0, "desiredDpa": 2}, {"lastValue": 5.0, "lastCheck": "2026-12-07T10:00:15Z", "desiredDpa": 2},
     True),
])
def test_a_daemons_status_is_written_only_when_it_changes(current: dict[str, Any], fields: dict[str, Any],
                                                          write: bool) -> None:
    from shardwise.operator.handlers import worth_writing

    assert worth_writing(current, fields) is write


def test_an_operator_that_cannot_load_its_kubeconfig_exits_2_saying_why(tmp_path: Path) -> None:
    """(kopf would retry its startup every minute with a traceback while the process looked alive.)"""
    import subprocess

    from tests.conftest import shardwise_command

    unreadable = tmp_path / "missing-kubeconfig"
    done = subprocess.run([*shardwise_command(), "operator", "--kubeconfig", str(unreadable)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done
    assert f"operator: cannot load the cluster configuration from {unreadable}: " in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
