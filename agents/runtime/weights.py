"""Deterministic weights for a preset, written as safetensors shards that a rank can read piecewise.

Layout of a weights directory:

    config.json                     {"model": preset, "seed": S, "architecture": {...}}
    dense.safetensors               embedding, norms, attention, dense FFNs, routers, shared experts, head
    experts-layer-{i:03d}.safetensors   routed experts of MoE layer i: w1/w3 [E, I, D], w2 [E, D, I]

Every tensor is drawn from its own generator seeded by (seed, name), so the values do not depend on the
order of generation and a rank can regenerate or load any one tensor alone. Weights are stored in float32;
the runtime computes in float64 on CPU (see docs/architecture.md: layouts then agree token for token).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardwise.api import ModelArchitecture

DENSE_FILE = "dense.safetensors"
CONFIG_FILE = "config.json"


def expert_file(layer: int) -> str:
    return f"experts-layer-{layer:03d}.safetensors"


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def tensor(seed: int, name: str, shape: tuple[int, ...], fan_in: int | None = None) -> torch.Tensor:
    """One weight: normal / sqrt(fan_in) for matrices, 1 + small noise for norm scales."""
    g = _generator(seed, name)
    if fan_in is None:  # a norm scale
        return 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float32, device="cpu")
    return torch.randn(shape, generator=g, dtype=torch.float32, device="cpu").div(fan_in**0.5)


def dense_shapes(arch: ModelArchitecture) -> Iterator[tuple[str, tuple[int, ...], int | None]]:
    """(name, shape, fan_in) of every non-routed-expert tensor."""
    d, v = arch.hidden_size, arch.vocab_size
    hq, hkv, dh = arch.num_heads, arch.kv_heads, arch.dim_head
    yield "embed", (v, d), 1
    for i in range(arch.num_layers):
        p = f"layers.{i}."
        yield p + "attn_norm", (d,), None
        yield p + "wq", (hq * dh, d), d
        yield p + "wk", (hkv * dh, d), d
        yield p + "wv", (hkv * dh, d), d
        yield p + "wo", (d, hq * dh), hq * dh
        yield p + "ffn_norm", (d,), None
        if arch.is_moe_layer(i):
            yield p + "router", (arch.num_experts, d), d
            for s in range(arch.num_shared_experts):
                w = arch.shared_width
                yield p + f"shared.{s}.w1", (w, d), d
                yield p + f"shared.{s}.w3", (w, d), d
                yield p + f"shared.{s}.w2", (d, w), w
        else:
            yield p + "ffn.w1", (arch.intermediate_size, d), d
            yield p + "ffn.w3", (arch.intermediate_size, d), d
            yield p + "ffn.w2", (d, arch.intermediate_size), arch.intermediate_size
    yield "norm", (d,), None
    yield "lm_head", (v, d), d


def expert_tensor(seed: int, arch: ModelArchitecture, layer: int, expert: int, which: str) -> torch.Tensor:
    d, i = arch.hidden_size, arch.moe_intermediate_size
    name = f"layers.{layer}.experts.{expert}.{which}"
    return tensor(seed, name, (d, i) if which == "w2" else (i, d), i if which == "w2" else d)


def generate(arch: ModelArchitecture, seed: int) -> dict[str, torch.Tensor]:
    """All weights in memory, routed experts stacked per layer as `layers.{i}.experts.w1` [E, I, D] etc."""
    out = {name: tensor(seed, name, shape, fan) for name, shape, fan in dense_shapes(arch)}
    for layer in range(arch.num_layers):
        if arch.is_moe_layer(layer):
            for which in ("w1", "w3", "w2"):
                out[f"layers.{layer}.experts.{which}"] = torch.stack(
                    [expert_tensor(seed, arch, layer, e, which) for e in range(arch.num_experts)]
                )
    return out


def write(directory: Path, model: str, arch: ModelArchitecture, seed: int) -> list[Path]:
    """Write a weights directory; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = generate(arch, seed)
    dense = {k: v.contiguous() for k, v in weights.items() if ".experts." not in k}
    files = [directory / DENSE_FILE]
    save_file(dense, str(files[0]))
    for layer in range(arch.num_layers):
        if arch.is_moe_layer(layer):
            path = directory / expert_file(layer)
            save_file({w: weights[f"layers.{layer}.experts.{w}"].contiguous() for w in ("w1", "w3", "w2")},
                      str(path))
            files.append(path)
    config = {"model": model, "seed": seed, "architecture": arch.model_dump(by_alias=True, mode="json")}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return [directory / CONFIG_FILE, *files]


def read_config(directory: Path) -> tuple[str, int, ModelArchitecture]:
    config = json.loads((directory / CONFIG_FILE).read_text())
    return config["model"], int(config["seed"]), ModelArchitecture.model_validate(config["architecture"])


def load_dense(directory: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Non-expert tensors (all, or only `names`)."""
    with safe_open(str(directory / DENSE_FILE), framework="pt") as f:
        keys = names if names is not None else list(f.keys())
        return {k: f.get_tensor(k) for k in keys}


def load_experts(directory: Path, layer: int, experts: list[int]) -> dict[str, torch.Tensor]:
    """Only the given routed experts of one layer: w1/w3 [n, I, D], w2 [n, D, I] (row slices of the file)."""
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(directory / expert_file(layer)), framework="pt") as f:
        for which in ("w1", "w3", "w2"):
            sl = f.get_slice(which)
            out[which] = torch.stack([sl[e : e + 1][0] for e in experts]) if experts else torch.empty(0)
    return out


def load_all(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor, experts stacked per layer as in `generate`."""
    _, _, arch = read_config(directory)
    out = load_dense(directory)
    for layer in range(arch.num_layers):
        if arch.is_moe_layer(layer):
            for which, t in load_experts(directory, layer, list(range(arch.num_experts))).items():
                out[f"layers.{layer}.experts.{which}"] = t
    return out
