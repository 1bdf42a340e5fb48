"""Hugging Face checkpoints made by transformers, served by distributed worlds of real rank processes: every
layout, a live expert migration, a scale 2 -> 4 -> 2 and a recovery return transformers' own greedy tokens
(float64 on the CPU), for prompts given as text (the checkpoint's tokenizer) and as token ids."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from shardwise.agents.client import AgentClient, call_all, world_request
from shardwise.agents.localrun import LocalDeployment
from shardwise.agents.proto import agent_pb2 as pb
from shardwise.agents.runtime.pool import LocalWorld

from tests.checkpoints import greedy, make_checkpoint
from tests.runtime.test_agent import TOKEN, post
from tests.runtime.test_recovery import standing_by, wait_until

pytestmark = pytest.mark.slow

PROMPTS: list[str | list[int]] = ["hello world", "attention groups serve", [5, 17, 100, 42, 7, 250], [9]]
N = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Any:
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:  # qwen3_moe sharded in many files, the others in one
            made[family] = make_checkpoint(tmp_path_factory.mktemp(family), family, shard=family == "qwen3_moe")
        return made[family]

    return get


@cache
def tokens(directory: Path, prompt: str | tuple[int, ...]) -> list[int]:
    if isinstance(prompt, tuple):
        return list(prompt)
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(directory))(prompt)["input_ids"])


@cache
def oracle(directory: Path, prompt: str | tuple[int, ...], n: int = N) -> list[int]:
    return greedy(directory, tokens(directory, prompt), n)


def key(prompt: str | list[int]) -> str | tuple[int, ...]:
    return prompt if isinstance(prompt, str) else tuple(prompt)


def check(world: LocalWorld, directory: Path, rid: str, prompt: str | list[int], n: int = N) -> None:
    got = world.result(rid)
    want = oracle(directory, key(prompt), n)
    assert got["token_ids"] == want, (prompt, got, want)
    assert got["finish_reason"] == ("stop" if len(want) < n else "length")


# each case adds what no other does (tp, dpa with redundant experts, pp, dense, tied embeddings, moeTp)
LAYOUTS = [
    ("qwen3_moe tp1", "qwen3_moe", {"tp": 1, "dpa": 1, "pp": 1}),
    ("qwen3_moe tp2 x dpa2 over ep4 with 2 redundant experts", "qwen3_moe",
     {"tp": 2, "dpa": 2, "pp": 1, "redundant_experts": 2}),
    ("qwen3_moe pp2 (3 layers over 2 stages)", "qwen3_moe", {"tp": 1, "dpa": 1, "pp": 2}),
    ("mixtral tp2 x dpa2 over ep4 with 3 redundant experts", "mixtral",
     {"tp": 2, "dpa": 2, "pp": 1, "redundant_experts": 3}),
    ("qwen3 dense tp3 (one of 3 kv heads each)", "qwen3", {"tp": 3, "dpa": 1, "pp": 1}),
    ("llama tied embeddings tp4 beyond its 2 kv heads", "llama", {"tp": 4, "dpa": 1, "pp": 1}),
    ("qwen3_moe moeTp2 inside tp2 (ep1)", "qwen3_moe", {"tp": 2, "dpa": 1, "pp": 1, "moe_tp": 2}),
    ("qwen3_moe moeTp2 across dpa groups, tp2 x dpa2 over ep2 with 2 redundant experts", "qwen3_moe",
     {"tp": 2, "dpa": 2, "pp": 1, "moe_tp": 2, "redundant_experts": 2}),
    ("mixtral moeTp2 x ep2 on dpa4 with 1 redundant expert", "mixtral",
     {"tp": 1, "dpa": 4, "pp": 1, "moe_tp": 2, "redundant_experts": 1}),
    ("qwen3_moe moeTp2 with pp2", "qwen3_moe", {"tp": 2, "dpa": 1, "pp": 2, "moe_tp": 2}),
    # DeepSeek-V3 (MLA): q LoRA, interleaved RoPE under YaRN, a first dense layer, group-limited routing with a
    # random correction bias; absorbed MLA for decode, plain for prompts (the default)
    ("deepseek_v3 tp1", "deepseek_v3", {"tp": 1, "dpa": 1, "pp": 1}),
    ("deepseek_v3 tp2 x dpa2 over ep4 with 2 redundant experts", "deepseek_v3",
     {"tp": 2, "dpa": 2, "pp": 1, "redundant_experts": 2}),
    # plain q_proj, RoPE on halves, two shared experts, no dense layer: one form of MLA throughout each
    ("deepseek_v3 plain-q pp2, absorbed MLA for prompts too", "deepseek_v3_plain",
     {"tp": 1, "dpa": 1, "pp": 2, "mla_absorb": "always"}),
    ("deepseek_v3 plain-q tp2 (2 of 4 heads each), plain MLA for decode too", "deepseek_v3_plain",
     {"tp": 2, "dpa": 1, "pp": 1, "mla_absorb": "never"}),
    # decode CP for MLA: the latent cache split by position, latent-space queries merged by LSE (striped, over
    # ag_rs and a2a: test_context.py's test_the_bytes_each_dcp_rank_sends_match_the_planners_formula)
    ("deepseek_v3 plain-q dcp2 contiguous (12 positions per rank) over a2a", "deepseek_v3_plain",
     {"tp": 1, "dpa": 1, "pp": 1, "cp": 2, "cp_mode": "dcp", "cp_layout": "contiguous", "cp_comm": "a2a",
      "max_model_len": 24}),
]


@pytest.mark.parametrize("family,layout", [(f, args) for _, f, args in LAYOUTS], ids=[n for n, _, _ in LAYOUTS])
def test_every_layout_returns_transformers_greedy_tokens(ckpt: Any, family: str, layout: dict[str, Any]) -> None:
    directory = ckpt(family)
    with LocalWorld({"generation": 1, "model": family, "weights_dir": str(directory), **layout}) as world:
        world.wait_ready()
        rids = [world.submit(p, N) for p in PROMPTS]  # all in flight together: continuous batching
        for prompt, rid in zip(PROMPTS, rids, strict=True):
            check(world, directory, rid, prompt)


@pytest.fixture(scope="module")
def moe_world(ckpt: Any) -> Iterator[tuple[LocalWorld, Path]]:
    directory = ckpt("qwen3_moe")
    with LocalWorld({"generation": 1, "model": "qwen3_moe", "weights_dir": str(directory), "tp": 1, "dpa": 2,
                     "pp": 1, "redundant_experts": 2}) as w:
        w.wait_ready()
        yield w, directory


def test_a_live_expert_migration_keeps_transformers_tokens(moe_world: tuple[LocalWorld, Path]) -> None:
    world, directory = moe_world
    rids = {world.submit(p, 40): p for p in ["hello world", "elastic expert parallel"]}
    rng = np.random.default_rng(3)
    target = {layer: rng.permutation([*range(6), 1, 4]).tolist() for layer in range(3)}
    moved, nbytes, _ = world.migrate(world.stats()[0]["mapGeneration"] + 1, target)
    assert moved > 0 and nbytes == moved * 3 * 24 * 48 * 8  # gate, up, down of one expert in float64
    for rid, p in rids.items():
        check(world, directory, rid, p, 40)
    assert world.stats()[0]["phy2log"][0] == target[0]
    check(world, directory, world.submit([3, 1, 4, 1, 5], N), [3, 1, 4, 1, 5])


def test_a_migration_moves_moe_tp_experts_as_their_shards(ckpt: Any) -> None:
    directory = ckpt("qwen3_moe")
    with LocalWorld({"generation": 1, "model": "qwen3_moe", "weights_dir": str(directory), "tp": 1, "dpa": 4,
                     "pp": 1, "moe_tp": 2, "redundant_experts": 2}) as world:
        world.wait_ready()
        rids = {world.submit(p, 30): p for p in ["hello world", [4, 8, 15, 16, 23, 42]]}
        target = {layer: [5, 4, 3, 2, 1, 0, 2, 3] for layer in range(3)}
        moved, nbytes, _ = world.migrate(world.stats()[0]["mapGeneration"] + 1, target)
        assert moved > 0 and nbytes == moved * 3 * 12 * 48 * 8  # each rank moves half of gate, up and down
        for rid, p in rids.items():
            check(world, directory, rid, p, 30)
        assert {tuple(s["phy2log"][0]) for s in world.stats()} == {tuple(target[0])}
        check(world, directory, world.submit("after the move", N), "after the move")


def test_a_live_expert_migration_of_deepseek_v3_keeps_transformers_tokens(ckpt: Any) -> None:
    directory = ckpt("deepseek_v3")
    with LocalWorld({"generation": 1, "model": "deepseek_v3", "weights_dir": str(directory), "tp": 1, "dpa": 2,
                     "pp": 1, "redundant_experts": 2}) as world:
        world.wait_ready()
        rids = {world.submit(p, 30): p for p in ["hello world", [4, 8, 15, 16, 23, 42]]}
        target = {layer: [5, 0, 3, 2, 1, 4, 0, 3] for layer in (1, 2)}  # layer 0 is dense
        moved, nbytes, _ = world.migrate(world.stats()[0]["mapGeneration"] + 1, target)
        assert moved > 0 and nbytes == moved * 3 * 14 * 48 * 8  # gate, up, down of one expert in float64
        for rid, p in rids.items():
            check(world, directory, rid, p, 30)
        assert world.stats()[0]["phy2log"][1] == target[1]
        check(world, directory, world.submit("after the move", N), "after the move")


# EP alone: the same on the presets (test_control); deepseek_v3: MLA caches and shared experts through the switch
@pytest.mark.parametrize("family,moe_tp", [("qwen3_moe", 2), ("deepseek_v3", 1)], ids=["moeTp2 x ep", "deepseek_v3"])
def test_a_scale_from_two_to_four_groups_and_back_keeps_transformers_tokens(ckpt: Any, family: str,
                                                                            moe_tp: int) -> None:
    directory = ckpt(family)
    with LocalWorld({"generation": 1, "model": family, "weights_dir": str(directory), "tp": 1, "dpa": 2,
                     "pp": 1, "redundant_experts": 2, "moe_tp": moe_tp}) as w:
        w.wait_ready()
        first = {w.submit(p, 30, group=i): p for i, p in enumerate(["hello world", "the quick brown fox"])}
        w.change_world(4)
        joined = {w.submit([7 + g, 8, 9], N, group=g): [7 + g, 8, 9] for g in (2, 3)}
        for rid, p in first.items():
            check(w, directory, rid, p, 30)
        for rid, p in joined.items():
            check(w, directory, rid, p)
        leaving = {w.submit(f"leaving {g}", N, group=g): f"leaving {g}" for g in (2, 3)}
        assert w.drain([2, 3], timeout=120) is True
        for rid, p in leaving.items():
            check(w, directory, rid, p)
        w.change_world(2)
        check(w, directory, w.submit("after the shrink", N), "after the shrink")


@pytest.mark.parametrize("family,moe_tp,redundant", [("mixtral", 1, 1), ("mixtral", 2, 1), ("deepseek_v3", 1, 2)],
                         ids=["ep2", "moeTp2", "deepseek_v3 ep2"])
def test_a_world_recovered_from_a_killed_rank_answers_with_transformers_tokens(ckpt: Any, family: str, moe_tp: int,
                                                                                redundant: int) -> None:
    directory = ckpt(family)
    with LocalDeployment(model=family, tp=1, dpa=2, pp=1, agents=2, redundant_experts=redundant, weights=str(directory),
                         token=TOKEN, log=lambda _m: None, moe_tp=moe_tp) as dep:
        dep.start()
        urls = dep.serving_urls()
        clients = [AgentClient(ap.grpc, TOKEN) for ap in dep.procs]
        os.kill(clients[1].health().ranks[0].pid, signal.SIGKILL)
        for c in clients:
            wait_until(lambda c=c: standing_by(c), 60, "the ranks to stand by (pod 1's restarted)")
        conf = world_request(generation=2, model=family, tp=1, dpa=2, pp=1, pods=[[0], [1]],
                             rendezvous=dep.rendezvous, weights=str(directory), redundant_experts=redundant,
                             moe_tp=moe_tp)
        call_all(clients, "Configure", conf, 60)
        call_all(clients, "Switch", pb.SwitchRequest(generation=2, recover=True), 120)
        for url, prompt in zip(urls, [[11, 12, 13], [21, 22]], strict=True):
            status, body, _ = post(url + "/v1/completions", {"prompt": prompt, "max_tokens": N})
            assert status == 200 and isinstance(body, dict), body
            assert body["token_ids"] == oracle(directory, tuple(prompt)), body
        for c in clients:
            c.close()
