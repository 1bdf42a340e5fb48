"""The rendezvous store listens on the pod's own address only: a process on the same machine that reaches the
port through another address of it is refused, so it cannot join or read a deployment's rendezvous."""

from __future__ import annotations

import datetime as dt
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("torch")

import torch.distributed as dist
from shardwise.agents.auth import TOKEN_ENV
from shardwise.agents.client import AgentClient
from shardwise.agents.runtime.store import serve_store

from tests.conftest import shardwise_command

POD_IP, OTHER_ADDRESS_OF_THE_NODE = "127.0.0.9", "127.0.0.1"
TOKEN = "rendezvous-test-token"


def refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.fixture
def pod0_agent() -> Iterator[str]:
    """`shardwise agent` as pod 0 runs it (hosting the store), on a pod IP of its own; yields its gRPC address."""
    cmd = [*shardwise_command(), "agent", "--deployment", "bind", "--pod-index", "0", "--host", POD_IP,
           "--grpc-port", "0", "--http-port", "0", "--metrics-port", "0", "--host-store", "--store-port", "0"]
    proc = subprocess.Popen(cmd, env={**os.environ, TOKEN_ENV: TOKEN}, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline() if proc.stdout else ""))
        reader.start()
        reader.join(120)
        assert line and line[0].startswith("agent "), f"the agent did not start (exit code {proc.poll()})"
        yield dict(kv.split("=", 1) for kv in line[0].split()[1:])["grpc"]
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)


def test_pod_0s_store_answers_on_the_pod_ip_and_refuses_other_addresses_of_the_node(pod0_agent: str) -> None:
    with AgentClient(pod0_agent, TOKEN) as agent:
        address = agent.describe().rendezvous_address
    host, port = address.rsplit(":", 1)
    assert host == POD_IP
    assert refused(OTHER_ADDRESS_OF_THE_NODE, int(port))
    client = dist.TCPStore(POD_IP, int(port), is_master=False, timeout=dt.timedelta(seconds=30))
    client.set("joined", "yes")
    assert client.get("joined") == b"yes"


def test_a_store_on_a_taken_address_is_an_error_and_a_freed_one_can_be_bound_again() -> None:
    store = serve_store(POD_IP)
    port = store.port
    with pytest.raises(OSError, match="in use"):
        serve_store(POD_IP, port)
    del store  # the store owns the listening socket and closes it
    deadline = time.monotonic() + 30
    while True:
        try:
            again = serve_store(POD_IP, port)
            break
        except OSError:
            assert time.monotonic() < deadline, f"port {port} was never freed"
            time.sleep(0.1)
    assert again.port == port and refused(OTHER_ADDRESS_OF_THE_NODE, port)
