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


def transformers_complete(directory: Path, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    """transformers' own greedy decode of a Hugging Face checkpoint, in float64 on the CPU: the reference no
    code of this project computes. Text prompts go through transformers' tokenizer of the checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardwise import checkpoint

    info = checkpoint.inspect(directory)  # the same refusals as the runtime's (a model type it does not run)
    tok = AutoTokenizer.from_pretrained(str(directory)) if info.has_tokenizer else None
    if isinstance(prompt, str):
        if tok is None:
            raise ValueError(f"{directory} has no tokenizer.json: give the prompt as token ids")
        ids = list(tok(prompt)["input_ids"])
    else:
        ids = list(prompt)
    bad = [i for i in ids if not 0 <= i < info.architecture.vocab_size]
    if bad or not ids:
        raise ValueError(f"token ids must be a non-empty list within 0..{info.architecture.vocab_size - 1}")
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float64,
                                                 experts_implementation="eager").eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    new = [int(t) for t in out[0, len(ids):]]
    eos = set(info.eos_token_ids)
    reason = "stop" if new and new[-1] in eos else "length"
    text = tok.decode(new, skip_special_tokens=True) if tok is not None else ""
    return {"token_ids": new, "text": text, "finish_reason": reason}
