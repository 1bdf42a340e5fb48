"""The reference model and its weights: deterministic, loadable piecewise, cache-consistent, and what the
oracle prints."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from shardwise.agents.runtime import tokenizer, weights  # noqa: E402
from shardwise.agents.runtime.model import ReferenceModel, SequenceCache, route  # noqa: E402
from shardwise.agents.runtime.oracle import complete  # noqa: E402

from shardwise.presets import model_preset  # noqa: E402
from tests.conftest import shardwise_command  # noqa: E402

TINY = model_preset("tiny-moe")


def test_the_same_seed_gives_the_same_weights_and_another_seed_different_ones() -> None:
    a, b, c = weights.generate(TINY, 0), weights.generate(TINY, 0), weights.generate(TINY, 1)
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["embed"], c["embed"])


def test_a_weights_directory_round_trips_and_serves_single_experts(tmp_path: Path) -> None:
    weights.write(tmp_path, "tiny-moe", TINY, 3)
    name, seed, arch = weights.read_config(tmp_path)
    assert (name, seed, arch) == ("tiny-moe", 3, TINY)
    memory, disk = weights.generate(TINY, 3), weights.load_all(tmp_path)
    assert memory.keys() == disk.keys() and all(torch.equal(memory[k], disk[k]) for k in memory)
    some = weights.load_experts(tmp_path, layer=2, experts=[5, 11])
    assert torch.equal(some["w1"], memory["layers.2.experts.w1"][[5, 11]])
    assert torch.equal(some["w2"], memory["layers.2.experts.w2"][[5, 11]])


def test_decoding_with_the_kv_cache_equals_recomputing_the_whole_sequence() -> None:
    model = ReferenceModel(TINY, weights.generate(TINY, 0))
    prompt = tokenizer.encode("cache me")
    cached, _ = model.generate(prompt, 6)
    seq = list(prompt)
    for _ in range(6):
        seq.append(int(model.forward(seq, SequenceCache.empty(TINY.num_layers)).argmax()))
    assert cached == seq[len(prompt):]


def test_the_router_picks_top_k_experts_with_weights_summing_to_one() -> None:
    x = torch.randn(7, TINY.hidden_size, dtype=torch.float64)
    router = torch.randn(TINY.num_experts, TINY.hidden_size, dtype=torch.float64)
    w, ids = route(x, router, TINY.top_k)
    assert ids.shape == (7, TINY.top_k) and torch.allclose(w.sum(-1), torch.ones(7, dtype=torch.float64))
    assert torch.equal(ids[:, 0], (x @ router.T).argmax(-1))


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-dense"])
def test_greedy_completions_are_deterministic_and_not_degenerate(model: str) -> None:
    a = complete(model, 0, "Hello, world", 12)
    assert a == complete(model, 0, "Hello, world", 12)
    assert len(a["token_ids"]) == 12 and a["finish_reason"] == "length"
    assert len(set(a["token_ids"])) > 3, "random weights should not collapse onto one token"


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    with pytest.raises(ValueError, match=r"within 0\.\.259, got \[300\]"):
        complete("tiny-moe", 0, [256, 300], 2)


def test_the_oracle_command_prints_json_matching_the_library(tmp_path: Path) -> None:
    out = subprocess.run([*shardwise_command(), "oracle", "--model", "tiny-moe", "--seed", "0",
                          "--prompt", "Hello", "--max-tokens", "5"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == complete("tiny-moe", 0, "Hello", 5)


def test_the_weights_command_writes_a_directory_the_oracle_reads(tmp_path: Path) -> None:
    cli = shardwise_command()
    gen = subprocess.run([*cli, "weights", "generate", "--model", "tiny-moe", str(tmp_path / "w")],
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    assert (tmp_path / "w" / "experts-layer-003.safetensors").exists()
    out = subprocess.run([*cli, "oracle", "--weights", str(tmp_path / "w"), "--prompt", "Hello", "--max-tokens", "5"],
                         capture_output=True, text=True, timeout=120)
    assert json.loads(out.stdout) == complete("tiny-moe", 0, "Hello", 5)
