"""`shardwise run` as a user runs it: addresses, serving URLs, `ready`, answers equal to the oracle, and
nothing left running after SIGTERM."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.request

import pytest

pytest.importorskip("torch")

from shardwise.agents.runtime.oracle import complete

from tests.conftest import shardwise_command


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split()[2] != "Z"


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = [int(p) for p in out.split()]
    return kids + [g for k in kids for g in _children(k)]


@pytest.mark.slow
def test_run_serves_the_oracle_tokens_and_stops_every_process_on_sigterm() -> None:
    proc = subprocess.Popen([*shardwise_command(), "run", "--model", "tiny-moe", "--tp", "2", "--dpa", "2",
                             "--agents", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "SHARDWISE_AGENT_TOKEN": "run-test"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line.strip()) for line in proc.stdout or []], daemon=True).start()
    seen: list[str] = []
    deadline = time.monotonic() + 240
    try:
        while "ready" not in seen:
            assert proc.poll() is None, f"run exited: {proc.stderr.read() if proc.stderr else ''}"
            try:
                seen.append(lines.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                pytest.fail(f"no `ready` within the deadline; output so far: {seen}")
        assert sum(line.startswith("agent ") and " grpc 127.0.0.1:" in line for line in seen) == 2
        urls = [line.split()[1] for line in seen if line.startswith("serving http://127.0.0.1:")]
        assert len(urls) == 2
        for url in urls:
            req = urllib.request.Request(url + "/v1/completions", method="POST",
                                         data=json.dumps({"prompt": "run me", "max_tokens": 6,
                                                          "temperature": 0}).encode())
            with urllib.request.urlopen(req, timeout=60) as r:
                got = json.load(r)["choices"][0]["token_ids"]
                assert got == complete("tiny-moe", 0, "run me", 6)["token_ids"]
        started = [proc.pid, *_children(proc.pid)]
        assert len(started) >= 1 + 2 + 4  # run, two agents, four ranks
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    assert code == 0
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in started):  # every process it started is gone, by PID
        assert time.monotonic() < deadline, [p for p in started if _alive(p)]
        time.sleep(0.1)
