"""The image tier (`make test-images`): the CPU image the Dockerfile builds, run by Docker as a user runs it.

- The image's agent (`shardwise run`, as its non-root user 10001) serves a transformers-made checkpoint mounted
  read-only, and its completions equal transformers' greedy decode.
- The image's operator (`shardwise operator`) runs against the local cluster with its kubeconfig mounted, and an
  InferenceDeployment applied with kubectl becomes Available and answers like the oracle.

Containers use the host's network, so every address is this machine's loopback. Every test skips, with the reason,
where Docker is missing or its daemon does not answer, or the image has not been built (`make test-images` builds it,
from a base made offline where none can be pulled: mk/offline-base.sh). Each container a test starts is removed by it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

IMAGE = "shardwise:0.1.0"
ROOT = Path(__file__).resolve().parents[2]


def _docker_reason() -> str | None:
    if shutil.which("docker") is None:
        return "docker is not installed (make test-images installs Debian's docker.io as root)"
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                          timeout=30)
    if info.returncode != 0:
        return f"the Docker daemon does not answer ({info.stderr.strip()[:200]}): make test-images starts it"
    image = subprocess.run(["docker", "image", "inspect", IMAGE], capture_output=True, timeout=30)
    if image.returncode != 0:
        return f"the image {IMAGE} is not built: make test-images"
    return None


@pytest.fixture(scope="module", autouse=True)
def docker() -> None:
    reason = _docker_reason()
    if reason:
        pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Container:
    """One `docker run -d` of the image, removed (with its processes) at the end."""

    def __init__(self, *args: str, volumes: dict[Path, str] | None = None) -> None:
        self.name = f"shardwise-test-{uuid.uuid4().hex[:10]}"
        mounts = [arg for host, inside in (volumes or {}).items() for arg in ("-v", f"{host}:{inside}:ro")]
        subprocess.run(["docker", "run", "-d", "--name", self.name, "--network", "host", *mounts, IMAGE, *args],
                       check=True, capture_output=True, timeout=60)

    def logs(self) -> str:
        done = subprocess.run(["docker", "logs", self.name], capture_output=True, text=True, timeout=30)
        return done.stdout + done.stderr

    def running(self) -> bool:
        done = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", self.name], capture_output=True,
                              text=True, timeout=30)
        return done.stdout.strip() == "true"

    def exec(self, *command: str) -> str:
        return subprocess.run(["docker", "exec", self.name, *command], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()

    def wait_log(self, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.logs():
            assert self.running(), f"the container exited:\n{self.logs()[-4000:]}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout:.0f} s:\n{self.logs()[-4000:]}"
            time.sleep(0.5)  # polling the container's log, with a deadline

    def remove(self) -> None:
        subprocess.run(["docker", "rm", "-f", self.name], capture_output=True, timeout=60)


@pytest.fixture
def containers() -> Iterator[list[Container]]:
    made: list[Container] = []
    yield made
    for c in made:
        c.remove()


def test_the_images_agent_serves_a_mounted_checkpoint_as_a_non_root_user_like_transformers(
        tmp_path: Path, containers: list[Container]) -> None:
    pytest.importorskip("transformers")
    from tests.checkpoints import greedy, make_checkpoint

    checkpoint = make_checkpoint(tmp_path / "llama", "llama")
    # transformers writes the weights for its own user only (0600): the image's user cannot read them, and says so
    refused = subprocess.run(["docker", "run", "--rm", "--network", "host", "-v", f"{checkpoint}:/models/llama:ro",
                              IMAGE, "run", "--model", "/models/llama"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1, refused
    assert "/models/llama/model.safetensors: cannot be read: Permission denied" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr, refused.stderr
    for f in checkpoint.iterdir():
        f.chmod(0o644)  # as a model volume is mounted: readable by the pod's user
    port = free_port()
    agent = Container("run", "--model", "/models/llama", "--served-model-name", "llama", "--router-port", str(port),
                      volumes={checkpoint: "/models/llama"})
    containers.append(agent)
    agent.wait_log("ready", timeout=240)
    assert agent.exec("id", "-u") == "10001"  # the image's user: no root in the container
    prompt = [5, 17, 42, 9]
    body = json.dumps({"model": "llama", "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        answer = json.loads(r.read())
    assert answer["choices"][0]["token_ids"] == greedy(checkpoint, prompt, 8), answer


def _available(session: object) -> dict[str, object] | None:
    status: dict[str, object] = session.status("tiny-moe")  # type: ignore[attr-defined]
    conds = {c["type"]: c["status"] for c in status.get("conditions") or []}  # type: ignore[union-attr]
    return status if conds.get("Available") == "True" else None


def test_the_images_operator_runs_a_deployment_on_the_local_cluster(tmp_path: Path,
                                                                     containers: list[Container]) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    pytest.importorskip("kopf")
    from shardwise.devcluster.session import LocalSession

    from tests.operator.common import assert_serves_like_the_oracle

    session = LocalSession(tmp_path / "cluster", operator=False)
    try:
        session.start()
        # the kubeconfig as a Secret volume would mount it: readable by the image's user (the session's is 0600)
        kubeconfig = tmp_path / "operator-kubeconfig"
        shutil.copy(session.kubeconfig, kubeconfig)
        kubeconfig.chmod(0o644)
        operator = Container("operator", "--kubeconfig", "/kube/config", volumes={kubeconfig: "/kube/config"})
        containers.append(operator)
        operator.wait_log("operator: running", timeout=120)
        session.kubectl("apply", "-f", str(ROOT / "examples" / "tiny-moe.yaml"))
        try:
            status = session.wait_for(lambda: _available(session), 300, "tiny-moe Available (the image's operator)")
        except Exception:
            print(operator.logs()[-4000:])  # for the failed test's report
            raise
        assert_serves_like_the_oracle(status, "The image's operator")
        assert operator.running(), operator.logs()[-3000:]
    finally:
        session.stop()
