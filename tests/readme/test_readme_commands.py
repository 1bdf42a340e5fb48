"""The README's local-cluster commands, typed as a user types them: each marked shell block of README.md runs
verbatim with bash in a fresh copy of the repository (relative paths, default flags, from the root), then the
deployment answers through `status.url` with the official openai client, equal to the oracle.

The blocks are those after the lines `<!-- run by tests/readme/test_readme_commands.py -->` (the operator started by
hand) and `<!-- run by tests/readme/test_readme_commands.py: chart -->` (the Helm chart's operator, in-cluster); each
runs in one bash process group (`set -e`: the first failing command fails the test with its output). Afterwards the
test stops the local cluster as the README says (`shardwise dev down`) and ends the process group (an operator the
block started in the background) by its PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
MARK = "<!-- run by tests/readme/test_readme_commands.py{} -->"


def readme_block(text: str, variant: str = "") -> str:
    """The fenced shell block right after the variant's mark."""
    mark = MARK.format(f": {variant}" if variant else "")
    at = text.find(mark)
    assert at >= 0, f"README.md has no block marked {mark!r}"
    found = re.search(r"```(?:sh|bash|shell)?\n(.*?)```", text[at:], re.S)
    assert found is not None, "the mark is not followed by a fenced block"
    return found.group(1)


def fresh_copy(target: Path) -> Path:
    """The repository's files as a clone has them (tracked and new files, nothing git ignores)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


@pytest.mark.parametrize(("variant", "namespace"), [("", "default"), ("chart", "shardwise-system")],
                         ids=["operator by hand", "the chart's operator"])
def test_the_readmes_local_cluster_commands_serve_the_example_like_the_oracle(tmp_path: Path, variant: str,
                                                                              namespace: str) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    openai = pytest.importorskip("openai")
    if variant == "chart":
        pytest.importorskip("helm_python")
    block = readme_block((ROOT / "README.md").read_text(), variant)
    clone = fresh_copy(tmp_path / "shardwise")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("KUBECONFIG", None)
    script = "set -euo pipefail\n" + block + '\nprintf "\\nURL=%s\\n" "$(kubectl get inferencedeployment tiny-moe ' \
             f"-n {namespace} -o jsonpath='{{.status.url}}')\"\n"
    proc = subprocess.Popen(["bash", "-c", script], cwd=clone, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)
    try:
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-6000:]
        url = next((line[4:] for line in out.splitlines() if line.startswith("URL=")), "")
        assert url.startswith("http://"), out[-3000:]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.completions.create(model="tiny-moe", prompt="The README", max_tokens=8, temperature=0)
        oracle = subprocess.run(["shardwise", "oracle", "--prompt", "The README", "--max-tokens", "8"], cwd=clone,
                                env=env, capture_output=True, text=True, timeout=300, check=True)
        assert answer.choices[0].text == json.loads(oracle.stdout)["text"], (answer, oracle.stdout)
    finally:
        if proc.poll() is None:
            proc.kill()
        subprocess.run(["shardwise", "dev", "down"], cwd=clone, env=env, capture_output=True, timeout=120)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)  # the operator the block left running in the background
