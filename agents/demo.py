"""The serving half of `make demo`: tiny-moe on 4 ranks (tp=2, dpa=2) behind 2 agents on this machine,
a few completions over HTTP printed beside the single-process oracle, a live expert migration, then every
process stopped."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable

from shardwise.agents.client import AgentClient, call_all
from shardwise.agents.localrun import LocalDeployment
from shardwise.agents.proto import agent_pb2 as pb
from shardwise.agents.runtime.oracle import complete

PROMPTS = ["Hello, world", "shardwise", "The quick brown fox"]


def _post(url: str, prompt: str, n: int) -> dict[str, object]:
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": prompt, "max_tokens": n}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        return dict(json.load(r))


def run(say: Callable[[str], None] = print) -> bool:
    """Returns True when every completion equals the oracle."""
    say("starting tiny-moe: tp=2 x dpa=2 = 4 ranks, 2 agents, 4 redundant experts (shardwise run)")
    ok = True
    with LocalDeployment(model="tiny-moe", tp=2, dpa=2, pp=1, agents=2, redundant_experts=4, log=say) as dep:
        dep.start()
        urls = dep.serving_urls()
        say(f"serving at {', '.join(urls)}")

        def check(label: str) -> None:
            nonlocal ok
            for i, prompt in enumerate(PROMPTS):
                got = _post(urls[i % len(urls)], prompt, 12)["token_ids"]
                want = complete("tiny-moe", 0, prompt, 12)["token_ids"]
                ok &= got == want
                say(f"  {label} {prompt!r:24} served {got} {'==' if got == want else '!='} oracle {want}")

        check("before migration")
        clients = [AgentClient(ap.grpc, dep.token) for ap in dep.procs]
        layers = [pb.LayerMap(layer=i, phy2log=[*range(15, -1, -1), 0, 5, 10, 15]) for i in range(4)]
        moved = call_all(clients, "UpdateExpertMap", pb.UpdateExpertMapRequest(generation=1, map_generation=1,
                                                                                layers=layers), 120)
        say(f"moved experts to map generation {moved[0].map_generation} while serving")
        check("after migration ")
        for c in clients:
            c.close()
    say("stopped every agent and rank")
    return ok
