"""The test suite's checkpoint maker (`tests/checkpoints.py`), loaded by path for the benchmarks (run as scripts,
they do not have the repository root on their import path)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def builder() -> Any:
    spec = importlib.util.spec_from_file_location("checkpoints", ROOT / "tests" / "checkpoints.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def qwen3_moe_9m(directory: Path) -> Path:
    """The benchmarks' checkpoint: a random Qwen3-MoE of about 9 M parameters (4 layers, hidden 256, 8 query and
    4 KV heads of 32, 8 experts of width 256, top-2, vocabulary 4096)."""
    return Path(builder().make_checkpoint(
        directory, "qwen3_moe", vocab_size=4096, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_experts=8,
        num_experts_per_tok=2))
