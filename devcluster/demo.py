"""The cluster half of `make demo`: a local Kubernetes (API server, 2 process-backed nodes x 4 GPUs), the CRD,
`shardwise operator`, then `examples/tiny-moe.yaml` applied with kubectl; it waits for Available showing the
phases as they pass, prints completions served through the operator's pods beside the oracle's, shows
`kubectl get idep`, deletes the deployment and stops everything."""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from .session import LocalSession

PROMPTS = ["Hello, world", "shardwise", "The quick brown fox"]
READY_S = 300


def _post(url: str, prompt: str, n: int) -> list[int]:
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": prompt, "max_tokens": n}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        return list(json.load(r)["token_ids"])


def run(example: Path, say: Callable[[str], None] = print) -> bool:
    """True when every completion equals the oracle."""
    from shardwise.agents.runtime.oracle import complete

    ok = True
    with tempfile.TemporaryDirectory(prefix="shardwise-demo-") as tmp, \
            LocalSession(tmp, nodes=2, gpus_per_node=4, log=say) as s:
        say(f"$ kubectl apply -f {example}")
        say(s.kubectl("apply", "--validate=false", "-f", str(example)).strip())
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
        say("$ kubectl get idep")
        say(s.kubectl("get", "idep").rstrip())
        st = s.status(name)
        for i, prompt in enumerate(PROMPTS):
            url = st["endpoints"][i % len(st["endpoints"])]
            got = _post(url, prompt, 12)
            want = complete("tiny-moe", 0, prompt, 12)["token_ids"]
            ok &= got == want
            say(f"  {prompt!r:24} served by {url}: {got} {'==' if got == want else '!='} oracle {want}")
        say(f"$ kubectl delete idep {name}")
        say(s.kubectl("delete", "idep", name, "--wait=true", timeout=120).strip())
    say("stopped the operator, every pod process, the nodes and the API server")
    return ok
