"""`shardwise oracle`: the same weights in one process, no parallelism: the correctness reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardwise.agents.runtime import tokenizer, weights
from shardwise.agents.runtime.model import ReferenceModel

from shardwise.presets import model_preset


def complete(model: str, seed: int, prompt: str | list[int], max_tokens: int,
             weights_dir: Path | None = None) -> dict[str, Any]:
    """Greedy completion as JSON-ready dict: token_ids, text, finish_reason."""
    if weights_dir is not None:
        _, seed, arch = weights.read_config(weights_dir)
        tensors = weights.load_all(weights_dir)
    else:
        arch = model_preset(model)
        tensors = weights.generate(arch, seed)
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    bad = [i for i in ids if not 0 <= i < arch.vocab_size]
    if bad:
        raise ValueError(f"token ids must be within 0..{arch.vocab_size - 1}, got {bad[:5]}")
    out, reason = ReferenceModel(arch, tensors).generate(ids, max_tokens, eos=tokenizer.EOS)
    return {"token_ids": out, "text": tokenizer.decode(out), "finish_reason": reason}
