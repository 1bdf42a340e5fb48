"""Where a rank's weights come from: a Hugging Face checkpoint, seeded weights on disk, or the seed itself.

Every source answers in the runtime's tensor names (`shardwise.checkpoint` lists them) and reads only the
slice asked for: `tensor(name, rows=(lo, hi))` reads rows lo..hi of a [out, in] matrix, `cols=` a column
range, from the safetensors file by its offsets (a memory map), so a rank never loads the whole checkpoint.
`experts(layer, ids)` returns the routed experts asked for, stacked: w1/w3 [n, I, D], w2 [n, D, I].
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from shardwise.agents.runtime import weights

from shardwise import checkpoint
from shardwise.api import ModelArchitecture

Range = tuple[int, int] | None


def shard(width: int, part: tuple[int, int]) -> tuple[int, int]:
    """[lo, hi) of MoE-TP shard `part` = (index, count) of an expert's intermediate width."""
    index, count = part
    return index * width // count, (index + 1) * width // count


def _sharded(got: dict[str, torch.Tensor], part: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Stacked experts (w1/w3 [n, I, D], w2 [n, D, I]) cut to one MoE-TP shard of I."""
    if part == (0, 1) or not got["w1"].numel():
        return got
    lo, hi = shard(got["w1"].shape[1], part)
    return {"w1": got["w1"][:, lo:hi], "w3": got["w3"][:, lo:hi], "w2": got["w2"][:, :, lo:hi]}


def _cut(t: torch.Tensor, rows: Range, cols: Range) -> torch.Tensor:
    if rows is not None:
        t = t[rows[0]:rows[1]]
    if cols is not None:
        t = t[:, cols[0]:cols[1]]
    return t


class WeightSource(Protocol):
    arch: ModelArchitecture

    def tensor(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor: ...

    def experts(self, layer: int, ids: list[int], part: tuple[int, int] = (0, 1)) -> dict[str, torch.Tensor]: ...


class SeededWeights:
    """The preset's weights generated from the seed, tensor by tensor."""

    def __init__(self, arch: ModelArchitecture, seed: int) -> None:
        self.arch, self.seed = arch, seed
        self.shapes = {n: (s, f) for n, s, f in weights.dense_shapes(arch)}

    def tensor(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        shape, fan = self.shapes[name]
        return _cut(weights.tensor(self.seed, name, shape, fan), rows, cols)

    def experts(self, layer: int, ids: list[int], part: tuple[int, int] = (0, 1)) -> dict[str, torch.Tensor]:
        return _sharded({w: torch.stack([weights.expert_tensor(self.seed, self.arch, layer, e, w) for e in ids])
                         for w in ("w1", "w3", "w2")}, part)


class SeededDirectory:
    """Seeded weights written by `shardwise weights generate`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        _, _, self.arch = weights.read_config(directory)

    def tensor(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        with safe_open(str(self.directory / weights.DENSE_FILE), framework="pt") as f:
            sl = f.get_slice(name)
            if rows is not None:
                return _cut(sl[rows[0]:rows[1]], None, cols)
            return _cut(f.get_tensor(name), None, cols)

    def experts(self, layer: int, ids: list[int], part: tuple[int, int] = (0, 1)) -> dict[str, torch.Tensor]:
        return _sharded(weights.load_experts(self.directory, layer, ids), part)


class HuggingFaceCheckpoint:
    """A Hugging Face checkpoint, checked on open (config, every tensor's presence, shape and dtype)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.info = checkpoint.inspect(directory)
        self.arch = self.info.architecture

    def tensor(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        key = checkpoint.hf_name(self.arch, name)
        with safe_open(str(self.directory / self.info.tensors[key].file), framework="pt") as f:
            sl = f.get_slice(key)
            part: torch.Tensor  # safetensors ships no types
            if rows is not None and cols is not None:
                part = sl[rows[0]:rows[1], cols[0]:cols[1]]
            elif rows is not None:
                part = sl[rows[0]:rows[1]]
            elif cols is not None:
                part = sl[:, cols[0]:cols[1]]
            else:
                part = f.get_tensor(key)
            return part

    def experts(self, layer: int, ids: list[int], part: tuple[int, int] = (0, 1)) -> dict[str, torch.Tensor]:
        """Only this rank's shard of each expert is read: gate/up rows, down columns."""
        if not ids:
            return {w: torch.empty(0) for w in ("w1", "w3", "w2")}
        lo, hi = shard(self.arch.moe_intermediate_size, part)
        cut = {"w1": {"rows": (lo, hi)}, "w3": {"rows": (lo, hi)}, "w2": {"cols": (lo, hi)}}
        return {w: torch.stack([self.tensor(f"layers.{layer}.experts.{e}.{w}", **cut[w]) for e in ids])
                for w in ("w1", "w3", "w2")}


def open_source(preset: str, seed: int, weights_dir: str | None) -> WeightSource:
    if weights_dir and checkpoint.is_checkpoint(Path(weights_dir)):
        return HuggingFaceCheckpoint(Path(weights_dir))
    if weights_dir:
        return SeededDirectory(Path(weights_dir))
    return SeededWeights(checkpoint.model_architecture(preset, None), seed)
