"""vLLM next to the reference runtime on one Hugging Face checkpoint, in one run (`make bench-vllm`).

A random Qwen3-MoE checkpoint of about 9 million parameters made by transformers (hidden 256, 4 layers, 8 query
and 4 KV heads of 32, 8 experts of width 256, top-2), float32, on this machine's CPUs:

- decode tokens/s of one request (64-token prompt, 64 tokens decoded, the time to first token taken off) for
  the reference runtime and for vLLM's CPU build at tp 1 and tp 2, vLLM started with the command line the
  operator derives for that layout (`shardwise.vllm.pod_command`), and the ratio vLLM / reference. At tp 2
  vLLM splits each expert over the TP group (ep 1: its CPU build has no expert parallelism), the reference
  runtime places whole experts on the two ranks (ep 2);
- apply to Available on the local cluster (kubectl apply, the operator, one pod) for `engine: reference` and
  `engine: vllm` on the same checkpoint, tp 1.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from checkpoints import ROOT, qwen3_moe_9m  # bench/checkpoints.py
from shardwise.agents.runtime.pool import LocalWorld
from shardwise.devcluster.session import LocalSession

from shardwise import vllm
from shardwise.api import InferenceDeploymentSpec
from shardwise.planner import plan

OUT = Path(__file__).parent / "results" / "vllm.json"
PROMPT = list(range(10, 74))
DECODE = 64
PYTHON = os.environ.get("SHARDWISE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")


def spec(directory: Path, tp: int, engine: str) -> dict[str, Any]:
    # vLLM's CPU build runs a MoE model without expert parallelism only: its experts split over the TP group
    ep = {"ep": 1} if engine == "vllm" else {}
    return {"model": {"source": {"path": str(directory)}, "dtype": "float32"},
            "hardware": {"gpu": "cpu", "gpusPerNode": 2}, "parallelism": {"tp": tp, "dpa": 1, **ep},
            "serving": {"maxModelLen": 512, "maxBatchTokens": 512, "workspaceMib": 64, "memoryFraction": 0.3},
            "runtime": {"engine": engine}}


def reference_tps(directory: Path, tp: int) -> float:
    with LocalWorld({"generation": 1, "model": "bench", "weights_dir": str(directory), "tp": tp, "dpa": 1, "pp": 1,
                     "dtype": "float32"}) as w:
        w.wait_ready(300)
        w.complete(PROMPT, 2)
        t0 = time.monotonic()
        w.result(w.submit(PROMPT, 1, stop_ids=()), 600)
        ttft = time.monotonic() - t0
        t0 = time.monotonic()
        w.result(w.submit(PROMPT, DECODE + 1, stop_ids=()), 600)
        return DECODE / (time.monotonic() - t0 - ttft)


def _complete(port: int, n: int) -> float:
    body = json.dumps({"model": "bench", "prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body.encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    return time.monotonic() - t0


def vllm_tps(directory: Path, tp: int, port: int) -> tuple[float, float]:
    """(start seconds, decode tokens/s) of vLLM at `tp`, started as the operator would start it."""
    s = InferenceDeploymentSpec.model_validate(spec(directory, tp, "vllm"))
    command = vllm.pod_command(s, plan(s), 0, served_name="bench", leader="127.0.0.1", host="127.0.0.1")
    args = [a if a != str(vllm.API_PORT) else str(port) for a in command.args]
    t0 = time.monotonic()
    proc = subprocess.Popen([PYTHON, *vllm.ENTRYPOINT, *args], env={**os.environ, **command.env}, cwd="/",
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM at tp {tp} exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - t0 > 600:
                raise RuntimeError("vLLM did not start within 600 s")
            time.sleep(0.5)
        start = time.monotonic() - t0
        _complete(port, 2)
        ttft = _complete(port, 1)
        return start, DECODE / (_complete(port, DECODE + 1) - ttft)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def apply_to_available(directory: Path, engine: str) -> float:
    os.environ["SHARDWISE_VLLM_PYTHON"] = PYTHON
    name = f"bench-{engine}"
    body = {"apiVersion": "shardwise.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": name},
            "spec": spec(directory, 1, engine)}
    if engine == "reference":
        body["spec"]["model"]["dtype"] = "float32"
    with tempfile.TemporaryDirectory() as tmp, LocalSession(tmp, nodes=1, gpus_per_node=2) as s:
        t0 = time.monotonic()
        s.kubectl("apply", "-f", "-", input=yaml.safe_dump(body))

        def available() -> bool:
            st = s.status(name)
            return st.get("phase") == "Running" and any(
                c["type"] == "Available" and c["status"] == "True" for c in st.get("conditions") or [])

        s.wait_for(available, 600, f"{name} Available")
        seconds = time.monotonic() - t0
        s.kubectl("delete", "inferencedeployment", name, "--wait=true", timeout=120)
        return seconds


def main() -> None:
    if not Path(PYTHON).exists():
        sys.exit(f"vLLM is not installed at {PYTHON}: run `make install`")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = qwen3_moe_9m(Path(tmp) / "qwen3-moe-9m")
        for tp in (1, 2):
            ref = reference_tps(directory, tp)
            start, tps = vllm_tps(directory, tp, 8450 + tp)
            rows.append({"tp": tp, "referenceTokensPerSecond": ref, "vllmTokensPerSecond": tps,
                         "vllmStartSeconds": start, "ratio": tps / ref})
        applied = {engine: apply_to_available(directory, engine) for engine in ("reference", "vllm")}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": f"{platform.machine()} {platform.python_version()}", "rows": rows,
                               "applyToAvailableSeconds": applied}, indent=2) + "\n")
    print(f"Qwen3-MoE, ~9 M parameters, float32, prompt {len(PROMPT)} tokens, {DECODE} decoded, one request")
    print("| layout | reference decode tokens/s | vLLM decode tokens/s | vLLM / reference | vLLM start |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| tp {r['tp']} | {r['referenceTokensPerSecond']:.1f} | {r['vllmTokensPerSecond']:.1f} "
              f"| {r['ratio']:.2f} x | {r['vllmStartSeconds']:.0f} s |")
    print(f"\napply to Available (local cluster, one pod, tp 1): reference {applied['reference']:.1f} s, "
          f"vLLM {applied['vllm']:.1f} s ({applied['vllm'] / applied['reference']:.2f} x)")
    print(f"written to {OUT}")


if __name__ == "__main__":
    main()
