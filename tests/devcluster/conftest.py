"""Fixtures of the local API server's tests: servers started and stopped per test, a CRD-serving one, and kubectl
pointed at one (skipped where kubectl is not installed). Test modules may define their own `api` to override."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.devcluster.apiclient import CRD_FILE, CRDS, Client


@pytest.fixture
def start() -> Iterator[Callable[..., Client]]:
    """Start API servers (options go to the emulator); every one is stopped at teardown."""
    pytest.importorskip("kmock")
    from shardwise.devcluster.apiserver import APIServer

    servers: list[APIServer] = []

    def _start(**options: Any) -> Client:
        server = APIServer(**options)
        servers.append(server)
        return Client(server.start())

    yield _start
    for server in servers:
        server.stop()


@pytest.fixture
def api(start: Callable[..., Client]) -> Client:
    return start()


@pytest.fixture
def crd_api(api: Client) -> Client:
    """A server with the InferenceDeployment CRD applied."""
    api.create(CRDS, yaml.safe_load(CRD_FILE.read_text()))
    return api


@pytest.fixture
def kubectl(api: Client, tmp_path: Path) -> Callable[..., str]:
    """`kubectl(*args)` against the `api` server: its stdout, stripped; with check=False its stderr (any exit)."""
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    from shardwise.devcluster.apiserver import write_kubeconfig

    config = write_kubeconfig(tmp_path / "kubeconfig", api.url)

    def run(*args: str, check: bool = True) -> str:
        done = subprocess.run(["kubectl", "--kubeconfig", str(config), "--cache-dir", str(tmp_path / "cache"),
                               *args], capture_output=True, text=True, timeout=30)
        assert not check or done.returncode == 0, done.stderr
        return done.stdout.strip() if check else done.stderr.strip()

    return run
