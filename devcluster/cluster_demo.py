"""The cluster half of `make demo`: a local Kubernetes (API server, 2 process-backed nodes x 4 GPUs), the CRD,
`shardwise operator`, then `examples/tiny-moe.yaml` applied with kubectl; it waits for Available showing the
phases as they pass and prints completions served through the deployment's router (`status.url`, which names the
DPA group that answered) beside the oracle's (`shardwise oracle`, a process of its own). Then elastic EP: a
scale-up 2 -> 4 and a drain scale-down 4 -> 2 in place, and the recovery from a deleted worker pod, each followed
by completions through the same URL checked against the oracle. It shows `kubectl get idep`, deletes the
deployment and stops everything."""

from __future__ import annotations

import json
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from .session import LocalSession, shardwise_command

PROMPTS = ["Hello, world", "shardwise", "The quick brown fox"]
READY_S = 300


def _post(url: str, prompt: str, n: int) -> tuple[list[int], str]:
    """A greedy completion through the deployment's router: its tokens and the DPA group that served it."""
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": prompt, "max_tokens": n, "temperature": 0}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        return list(json.load(r)["choices"][0]["token_ids"]), r.headers.get("X-Shardwise-Group", "?")


def oracle(prompt: str, n: int) -> list[int]:
    """The single-process reference, as a user would get it: `shardwise oracle`."""
    out = subprocess.run([*shardwise_command(), "oracle", "--prompt", prompt, "--max-tokens", str(n)],
                         capture_output=True, text=True, timeout=120, check=True)
    return list(json.loads(out.stdout)["token_ids"])


def run(example: Path, say: Callable[[str], None] = print) -> bool:
    """True when every completion equals the oracle."""
    ok = True
    with tempfile.TemporaryDirectory(prefix="shardwise-demo-") as tmp, \
            LocalSession(tmp, nodes=2, gpus_per_node=4, log=say) as s:
        say(f"$ kubectl apply -f {example}")
        say(s.kubectl("apply", "-f", str(example)).strip())
        name = "tiny-moe"
        started = time.monotonic()

        def progress() -> str:
            st = s.status(name)
            return (f"phase={st.get('phase') or '-'} ready={st.get('ready') or '0/?'} "
                    f"world generation={st.get('worldGeneration') or '-'}")

        def available() -> bool:
            return s.status(name).get("phase") == "Running" and s.condition(name, "Available") == "True"

        s.wait_for(available, READY_S, f"{name} to become Available", progress=progress,
                   log=lambda text: say(f"  {time.monotonic() - started:5.1f} s  {text}"))
        say(f"Available after {time.monotonic() - started:.1f} s")
        say("$ kubectl get idep -o wide   # URL: the deployment's router, one address through every change")
        say(s.kubectl("get", "idep", "-o", "wide").rstrip())

        def check() -> None:
            nonlocal ok
            url = s.status(name)["url"]
            for prompt in PROMPTS:
                got, group = _post(url, prompt, 12)
                want = oracle(prompt, 12)
                ok &= got == want
                say(f"  {prompt!r:24} {url} -> DPA group {group}: {got} {'==' if got == want else '!='} "
                    f"oracle {want}")

        def operation(kind: str, dpa: int, *command: str) -> None:
            say(f"$ kubectl {' '.join(command)}")
            say(s.kubectl(*command).strip())
            began = time.monotonic()

            def finished() -> bool:
                st = s.status(name)
                op = st.get("elastic") or {}
                return (op.get("operation") == kind and op.get("phase") == "Done" and st.get("dpa") == dpa
                        and st.get("phase") == "Running")

            def stage() -> str:
                st = s.status(name)
                op = st.get("elastic") or {}
                return (f"phase={st.get('phase')} {op.get('operation') or ''} {op.get('phase') or ''} "
                        f"dpa={st.get('dpa')}")

            s.wait_for(finished, READY_S, f"{kind} to dpa {dpa}", progress=stage,
                       log=lambda text: say(f"  {time.monotonic() - began:5.1f} s  {text}"))
            say(f"  {s.status(name)['elastic']['lastResult']}")
            check()

        check()
        say("\n-- elastic EP: the ranks that stay are never restarted --")
        operation("ScaleUp", 4, "scale", "idep", name, "--replicas", "4")
        say("$ kubectl get idep")
        say(s.kubectl("get", "idep").rstrip())
        operation("ScaleDown", 2, "scale", "idep", name, "--replicas", "2")
        say("\n-- recovery: a worker pod is lost; the survivors re-form the world, then a new pod restores dpa --")
        operation("ScaleUp", 2, "delete", "pod", f"{name}-1", "--wait=false")
        say("  " + "; ".join(e["message"] for e in (s.get("events") or {}).get("items", [])
                             if e["reason"] == "Recovered")[-300:])
        say("$ kubectl get idep")
        say(s.kubectl("get", "idep").rstrip())
        say(f"$ kubectl delete idep {name}")
        say(s.kubectl("delete", "idep", name, "--wait=true", timeout=120).strip())
    say("stopped the operator, every pod process, the nodes and the API server")
    return ok
