"""Context parallelism in the reference runtime, checked against transformers' greedy tokens: prefill CP (ring
attention) and decode CP (KV shards merged by LSE, over ag_rs or a2a) in each layout, composed with TP, DPA,
MoE-TP and PP; the causal work and the bytes each rank sends, read from what the ranks computed."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from shardwise.agents.runtime import context as cpctx
from shardwise.agents.runtime.pool import LocalWorld

from shardwise import cost
from shardwise.checkpoint import inspect
from tests.checkpoints import greedy, make_checkpoint

PROMPTS = [list(range(40, 77)), list(range(100, 119)), [7, 8, 9]]  # 37, 19 and 3 tokens: uneven over any cp
N = 10


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Any:
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            extra = {"num_experts": 8} if family == "qwen3_moe" else {}
            made[family] = make_checkpoint(tmp_path_factory.mktemp(family), family, tokenizer=False, **extra)
        return made[family]

    return get


@cache
def oracle(directory: Path, prompt: tuple[int, ...], n: int = N) -> list[int]:
    return greedy(directory, list(prompt), n)


def test_the_merge_of_shards_equals_attention_over_all_keys() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(5, 3, 8, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(10, 15)
    full, _, _ = cpctx.partial_attention(q, pos, k, v, pos)
    for layout in ("contiguous", "striped"):
        owner = cpctx.owners(pos, 3, "dcp", layout, 0, 16)
        parts = [cpctx.partial_attention(q, pos, k[owner == r], v[owner == r], pos[owner == r]) for r in range(3)]
        merged = cpctx.merge(torch.stack([o for o, _, _ in parts]), torch.stack([lse for _, lse, _ in parts]))
        assert torch.allclose(merged, full, atol=1e-12)


LAYOUTS = [
    ("pcp contiguous cp2", "qwen3_moe", {"cp": 2, "cp_mode": "pcp", "cp_layout": "contiguous"}),
    ("pcp zigzag cp2", "qwen3_moe", {"cp": 2, "cp_mode": "pcp", "cp_layout": "zigzag"}),
    ("pcp zigzag cp3 on a dense model", "qwen3", {"cp": 3, "cp_mode": "pcp", "cp_layout": "zigzag"}),
    ("dcp striped cp2 a2a", "qwen3_moe", {"cp": 2, "cp_mode": "dcp", "cp_layout": "striped", "cp_comm": "a2a"}),
    ("dcp contiguous cp2 a2a", "qwen3_moe", {"cp": 2, "cp_mode": "dcp", "cp_layout": "contiguous", "cp_comm": "a2a",
                                             "max_model_len": 64}),
    ("dcp striped cp3 ag_rs on a dense model", "qwen3", {"cp": 3, "cp_mode": "dcp", "cp_comm": "ag_rs"}),
    ("pcp zigzag cp2 x tp2", "qwen3_moe", {"cp": 2, "tp": 2, "cp_mode": "pcp", "cp_layout": "zigzag"}),
    ("dcp cp2 x dpa2 a2a (ep4)", "qwen3_moe", {"cp": 2, "dpa": 2, "cp_mode": "dcp", "cp_comm": "a2a"}),
    ("pcp cp2 x moeTp2", "qwen3_moe", {"cp": 2, "moe_tp": 2, "cp_mode": "pcp", "cp_layout": "striped"}),
    ("dcp cp2 with pp2", "qwen3_moe", {"cp": 2, "pp": 2, "cp_mode": "dcp"}),
]


@pytest.mark.slow
@pytest.mark.parametrize("family,layout", [(f, a) for _, f, a in LAYOUTS], ids=[n for n, _, _ in LAYOUTS])
def test_every_cp_layout_returns_transformers_greedy_tokens(ckpt: Any, family: str, layout: dict[str, Any]) -> None:
    directory = ckpt(family)
    spec = {"generation": 1, "model": family, "weights_dir": str(directory), "tp": 1, "dpa": 1, "pp": 1, **layout}
    with LocalWorld(spec) as world:
        world.wait_ready()
        rids = [world.submit(p, N) for p in PROMPTS]
        for prompt, rid in zip(PROMPTS, rids, strict=True):
            assert world.result(rid)["token_ids"] == oracle(directory, tuple(prompt)), (layout, prompt)


@pytest.mark.slow
@pytest.mark.parametrize("layout,work", [
    ("zigzag", [132, 132, 132, 132]),  # S = 32, CP = 4, every rank 132 K/V positions
    ("contiguous", [36, 100, 164, 228]),
    ("striped", [120, 128, 136, 144]),
])
def test_each_ranks_causal_work_is_what_its_layout_predicts(ckpt: Any, layout: str, work: list[int]) -> None:
    directory = ckpt("qwen3")
    arch = inspect(directory).architecture
    with LocalWorld({"generation": 1, "model": "qwen3", "weights_dir": str(directory), "tp": 1, "dpa": 1, "pp": 1,
                     "cp": 4, "cp_mode": "pcp", "cp_layout": layout}) as world:
        world.wait_ready()
        prompt = list(range(50, 82))
        assert world.complete(prompt, 1)["token_ids"] == oracle(directory, tuple(prompt), 1)
        per_rank = [s["cpWork"] // (arch.num_heads * arch.num_layers) for s in sorted(world.stats(),
                                                                                     key=lambda s: s["rank"])]
    assert per_rank == work
    from shardwise.api import CpLayout
    from shardwise.cp import causal_work

    assert per_rank == causal_work(32, 4, CpLayout(layout))  # the planner's figure


@pytest.mark.slow
@pytest.mark.parametrize("comm", ["ag_rs", "a2a"])
@pytest.mark.parametrize("family,cp", [("qwen3", 3), ("deepseek_v3", 2)])
def test_the_bytes_each_dcp_rank_sends_match_the_planners_formula(ckpt: Any, comm: str, family: str, cp: int) -> None:
    """GQA's queries and outputs per head, or MLA's over the latent cache (queries of kv_lora + rope, partial
    outputs of kv_lora), as the planner counts them."""
    directory = ckpt(family)
    arch = inspect(directory).architecture
    prompt, steps = list(range(60, 72)), 4
    with LocalWorld({"generation": 1, "model": family, "weights_dir": str(directory), "tp": 1, "dpa": 1, "pp": 1,
                     "cp": cp, "cp_mode": "dcp", "cp_comm": comm}) as world:
        world.wait_ready()
        assert world.complete(prompt, steps)["token_ids"] == oracle(directory, tuple(prompt), steps)
        sent = [s["cpBytes"] for s in world.stats()]
    tokens = [len(prompt)] + [1] * (steps - 1)  # the prefill step, then one token per decode step
    lse = sum((cp - 1) * t * arch.num_heads // cp * 8 for t in tokens) * arch.num_layers
    if comm == "ag_rs":
        want = sum(cost.dcp_send_bytes(arch, 1, cp, t, 8) for t in tokens) * arch.num_layers
        assert all(s["q"] + s["o"] == want for s in sent), (sent, want)
    else:  # the planner counts the LSE in float32; the runtime sends it in its float64
        want = sum(cost.dcp_a2a_send_bytes(arch, 1, cp, t, 8) for t in tokens) * arch.num_layers
        assert all(s["o"] + s["lse"] - lse // 2 == want for s in sent), (sent, want)
    if family == "deepseek_v3":  # per token and layer, 3 of the 6 heads go to the other rank: ag_rs a query of
        # latent 23 + rope 8 and an output of latent 23; a2a the output and a float32 LSE
        per_token = 3 * (23 + 8 + 23) * 8 if comm == "ag_rs" else 3 * 23 * 8 + 3 * 4
        assert want == sum(tokens) * per_token * arch.num_layers


@pytest.mark.slow
def test_shardwise_run_serves_cp_and_moe_tp_over_two_agents_like_transformers(ckpt: Any) -> None:
    import json
    import os
    import queue
    import signal
    import subprocess
    import threading
    import time
    import urllib.request

    from shardwise.agents.localrun import shardwise_command

    directory = ckpt("qwen3_moe")
    proc = subprocess.Popen([*shardwise_command(), "run", "--model", str(directory), "--tp", "1", "--cp", "2",
                             "--cp-mode", "pcp", "--cp-layout", "zigzag", "--moe-tp", "2", "--agents", "2",
                             "--max-model-len", "128"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or []], daemon=True).start()
    try:
        urls, deadline = [], time.monotonic() + 240
        while (line := lines.get(timeout=max(0.1, deadline - time.monotonic())).strip()) != "ready":
            if line.startswith("serving "):
                urls.append(line.split()[1])
        assert len(urls) == 1  # one DPA group over both agents
        body = {"model": directory.name, "prompt": PROMPTS[0], "max_tokens": N, "temperature": 0}
        req = urllib.request.Request(urls[0] + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.load(r)["choices"][0]["token_ids"] == oracle(directory, tuple(PROMPTS[0]))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


@pytest.mark.slow
def test_a_cp_world_grows_and_shrinks_in_place_keeping_its_kv_shards(ckpt: Any) -> None:
    directory = ckpt("qwen3_moe")
    with LocalWorld({"generation": 1, "model": "qwen3_moe", "weights_dir": str(directory), "tp": 1, "dpa": 1,
                     "pp": 1, "cp": 2, "cp_mode": "pcp", "cp_layout": "zigzag"}) as w:
        w.wait_ready()
        first = w.submit(PROMPTS[0], 30, group=0)  # in flight across the change, its KV split over 2 ranks
        w.change_world(2)
        assert w.spec.world_size == 4
        joined = w.submit(PROMPTS[1], N, group=1)
        assert w.result(first)["token_ids"] == oracle(directory, tuple(PROMPTS[0]), 30)
        assert w.result(joined)["token_ids"] == oracle(directory, tuple(PROMPTS[1]))
        assert w.drain([1], timeout=120) is True
        w.change_world(1)
        assert w.complete(PROMPTS[2], N)["token_ids"] == oracle(directory, tuple(PROMPTS[2]))


@pytest.mark.slow
def test_a_cp_world_recovered_from_a_killed_rank_answers_like_transformers(ckpt: Any) -> None:
    import os
    import signal

    from shardwise.agents.client import AgentClient, call_all, world_request
    from shardwise.agents.localrun import LocalDeployment
    from shardwise.agents.proto import agent_pb2 as pb

    from tests.runtime.test_agent import TOKEN, post
    from tests.runtime.test_recovery import standing_by, wait_until

    directory = ckpt("qwen3_moe")
    cp = {"cp": 2, "cp_mode": "dcp", "cp_layout": "striped", "cp_comm": "a2a"}
    with LocalDeployment(model="qwen3_moe", tp=1, dpa=2, pp=1, agents=2, weights=str(directory), token=TOKEN,
                         log=lambda _m: None, **cp) as dep:  # each agent: one DPA group's two CP ranks
        dep.start()
        urls = dep.serving_urls()
        clients = [AgentClient(ap.grpc, TOKEN) for ap in dep.procs]
        os.kill(clients[1].health().ranks[1].pid, signal.SIGKILL)
        for c in clients:
            wait_until(lambda c=c: standing_by(c), 60, "the ranks to stand by (pod 1's restarted)")
        conf = world_request(generation=2, model="qwen3_moe", tp=1, dpa=2, pp=1, pods=[[0, 1], [2, 3]],
                             rendezvous=dep.rendezvous, weights=str(directory), **cp)
        call_all(clients, "Configure", conf, 60)
        call_all(clients, "Switch", pb.SwitchRequest(generation=2, recover=True), 120)
        for url, prompt in zip(urls, PROMPTS[:2], strict=True):
            status, body, _ = post(url + "/v1/completions", {"prompt": prompt, "max_tokens": N})
            assert status == 200 and isinstance(body, dict), body
            assert body["token_ids"] == oracle(directory, tuple(prompt)), body
        for c in clients:
            c.close()


@pytest.mark.slow
def test_a_live_expert_migration_in_a_cp_world_keeps_transformers_tokens(ckpt: Any) -> None:
    directory = ckpt("qwen3_moe")
    with LocalWorld({"generation": 1, "model": "qwen3_moe", "weights_dir": str(directory), "tp": 1, "dpa": 1,
                     "pp": 1, "cp": 2, "cp_mode": "pcp", "cp_layout": "striped", "redundant_experts": 2}) as w:
        w.wait_ready()
        rid = w.submit(PROMPTS[0], 30)
        target = {layer: [7, 6, 5, 4, 3, 2, 1, 0, 1, 6] for layer in range(3)}
        moved, _, _ = w.migrate(w.stats()[0]["mapGeneration"] + 1, target)
        assert moved > 0
        assert w.result(rid)["token_ids"] == oracle(directory, tuple(PROMPTS[0]), 30)
        assert {tuple(s["phy2log"][0]) for s in w.stats()} == {tuple(target[0])}
