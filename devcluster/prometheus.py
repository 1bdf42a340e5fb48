"""A real Prometheus server for the local cluster (Debian's `prometheus` package, 2.x).

`PrometheusServer` writes a config whose only job scrapes the targets listed in a file-based service
discovery file (`targets.json`), starts `prometheus` on 127.0.0.1 with its own data directory, waits for
`/-/ready`, and is stopped by PID. `set_targets` rewrites the discovery file; Prometheus notices the change
by itself (file_sd watches the file), so pods can come and go while it runs. `query` calls the HTTP API.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

SCRAPE_INTERVAL_S = 1


class PrometheusMissing(RuntimeError):
    """The `prometheus` binary is not installed (`make install` installs it with apt-get where it can)."""


def find_binary() -> str:
    path = shutil.which("prometheus") or ("/usr/bin/prometheus" if os.path.exists("/usr/bin/prometheus") else None)
    if path is None:
        raise PrometheusMissing("prometheus is not installed: run `make install` (apt-get install prometheus)")
    return path


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class PrometheusServer:
    def __init__(self, state_dir: Path, *, host: str = "127.0.0.1", port: int = 0,
                 labels: dict[str, str] | None = None) -> None:
        self.dir = Path(state_dir)
        self.host = host
        self.port = port or _free_port(host)
        self.labels = labels or {}
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def targets_file(self) -> Path:
        return self.dir / "targets.json"

    def write_config(self) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        if not self.targets_file.exists():
            self.set_targets([])
        config = self.dir / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {SCRAPE_INTERVAL_S}s\n"
            f"  evaluation_interval: {SCRAPE_INTERVAL_S}s\n"
            "scrape_configs:\n"
            "  - job_name: shardwise-pods\n"
            "    file_sd_configs:\n"
            f"      - files: ['{self.targets_file}']\n"
            "        refresh_interval: 1s\n"
        )
        return config

    def set_targets(self, targets: list[str], labels: dict[str, dict[str, str]] | None = None) -> None:
        """Scrape exactly these host:port targets (labels per target are optional). Written atomically."""
        groups = [{"targets": [t], "labels": {**self.labels, **(labels or {}).get(t, {})}} for t in targets]
        tmp = self.targets_file.with_suffix(".tmp")
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.targets_file)

    def start(self, timeout: float = 30) -> str:
        config = self.write_config()
        log = open(self.dir / "prometheus.log", "ab")  # noqa: SIM115 - kept open for the child's lifetime
        self.proc = subprocess.Popen(
            [find_binary(), f"--config.file={config}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address={self.host}:{self.port}", "--storage.tsdb.retention.time=1d"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with code {self.proc.returncode}; see {self.dir}/prometheus.log")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"prometheus did not become ready within {timeout:g} s")
            time.sleep(0.1)  # polling a starting server

    def query(self, promql: str) -> list[dict[str, Any]]:
        """Instant query; returns the result vector (raises RuntimeError on a Prometheus error)."""
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"query {promql!r} failed: {body.get('error')}")
        return list(body["data"]["result"])

    def stop(self, timeout: float = 10) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
