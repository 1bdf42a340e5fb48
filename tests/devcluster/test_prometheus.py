"""A real Prometheus server scrapes a target it discovers from the targets file and answers a query."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from shardwise.devcluster.prometheus import PrometheusMissing, PrometheusServer, find_binary

try:
    find_binary()
    MISSING = ""
except PrometheusMissing as e:
    MISSING = str(e)


@pytest.mark.slow
@pytest.mark.skipif(bool(MISSING), reason=MISSING)
def test_prometheus_scrapes_a_discovered_target_and_answers_a_query(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    Gauge("shardwise_queue_depth", "test gauge", registry=registry).set(7)
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        with PrometheusServer(tmp_path / "prom", labels={"deployment": "test"}) as prom:
            prom.set_targets([f"127.0.0.1:{server.server_port}"])  # discovered while Prometheus runs
            deadline = time.monotonic() + 60
            while not (result := prom.query('shardwise_queue_depth{deployment="test"}')):
                assert time.monotonic() < deadline, "no sample scraped within 60 s"
                time.sleep(0.2)  # polling the condition, with a deadline
            assert float(result[0]["value"][1]) == 7.0
            assert prom.proc is not None
            pid = prom.proc.pid
        assert prom.proc.poll() is not None, f"prometheus (pid {pid}) still running after stop"
    finally:
        server.shutdown()


def test_a_bad_query_is_reported_with_the_prometheus_error(tmp_path: Path) -> None:
    if MISSING:
        pytest.skip(MISSING)
    with PrometheusServer(tmp_path / "prom") as prom, pytest.raises(Exception, match=r"parse error|bad_data|400"):
        prom.query("sum(")
