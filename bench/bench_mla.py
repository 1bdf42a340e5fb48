"""`make bench-mla`: MLA in the reference runtime next to transformers on one DeepSeek-V3 checkpoint.

A random DeepSeek-V3 checkpoint made by transformers (4 layers, hidden 256, 8 heads of nope 32 + rope 16 and value
32, q LoRA 96, latent 64, 8 experts of width 256 in 4 groups, top-2, a shared expert, a first dense layer,
vocabulary 4096), float64 on this machine's CPUs, in one run:

- KV cache bytes per token on one rank, measured from the cache tensors after a prompt (every layer), next to the
  ledger's figure and next to MHA of the same heads and widths (what MLA's latent replaces) and GQA of the same
  widths with 2 KV heads (4 query heads per KV head; 1 KV head per rank on TP 2), for TP 1 and 2;
- decode tokens/s of one request after a 256-token prompt: the runtime on 1 rank with the absorbed form for decode
  (the default) and with the plain form throughout, and transformers' `generate`.

Writes bench/results/mla.json (the machine and the run's date with the figures) and prints the tables.
"""

from __future__ import annotations

import json
import platform
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from checkpoints import builder  # bench/checkpoints.py
from shardwise.agents.runtime.engine import Shards, WorldSpec
from shardwise.agents.runtime.model import LayerCache, mla_attention
from shardwise.agents.runtime.pool import LocalWorld
from shardwise.agents.runtime.sources import HuggingFaceCheckpoint

from shardwise import ledger

OUT = Path(__file__).parent / "results" / "mla.json"
GQA_KV_HEADS = 2
PROMPT = [10 + (i * 37) % 4000 for i in range(256)]
DECODE = 32


def make(directory: Path) -> Path:
    return Path(builder().make_checkpoint(
        directory, "deepseek_v3", tokenizer=False, vocab_size=4096, hidden_size=256, intermediate_size=512,
        moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=8, q_lora_rank=96, kv_lora_rank=64,
        qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, n_group=4, topk_group=2,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def kv_rows(directory: Path) -> list[dict[str, Any]]:
    source = HuggingFaceCheckpoint(directory)
    a = source.arch
    rows = []
    for tp in (1, 2):
        spec = WorldSpec(generation=1, tp=tp, dpa=1, pp=1, store_host="127.0.0.1", store_port=0, model="bench",
                         weights_dir=str(directory))
        shards = Shards(source, spec, 0, 0, range(a.num_layers))
        x = torch.randn(len(PROMPT), a.hidden_size, dtype=torch.float64)
        measured = 0
        for layer in range(a.num_layers):
            cache = LayerCache()
            mla_attention(x, torch.arange(len(PROMPT)), cache, shards.w, f"layers.{layer}.", a, absorbed=False)
            assert cache.k is not None and cache.v is not None
            measured += cache.k.numel() * cache.k.element_size() + cache.v.numel() * cache.v.element_size()
        heads = a.num_heads // tp
        per_head = (a.nope_head_dim + a.rope_head_dim + a.v_head_dim) * 8  # one head's K and V, float64
        rows.append({"tp": tp, "measuredBytesPerToken": measured // len(PROMPT),
                     "ledgerBytesPerToken": a.num_layers * ledger.kv_bytes_per_token_per_layer(a, tp, 8),
                     "mhaBytesPerToken": a.num_layers * heads * per_head,
                     "gqaBytesPerToken": a.num_layers * max(1, GQA_KV_HEADS // tp) * per_head})
    return rows


def transformers_tps(directory: Path) -> float:
    model = builder().transformers_model(directory)
    torch.set_num_threads(1)  # as one rank process runs
    ids = torch.tensor([PROMPT])

    def gen(n: int) -> float:
        t0 = time.monotonic()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        return time.monotonic() - t0

    gen(2)
    first = min(gen(1) for _ in range(2))
    return DECODE / (gen(DECODE + 1) - first)


def runtime_tps(directory: Path, absorb: str) -> float:
    with LocalWorld({"generation": 1, "model": "bench", "weights_dir": str(directory), "tp": 1, "dpa": 1, "pp": 1,
                     "mla_absorb": absorb, "max_batch_tokens": 1024}) as w:
        w.wait_ready(300)
        w.complete(PROMPT, 2)  # warm up
        t0 = time.monotonic()
        w.result(w.submit(PROMPT, 1, stop_ids=()), 600)
        first = time.monotonic() - t0
        t0 = time.monotonic()
        w.result(w.submit(PROMPT, DECODE + 1, stop_ids=()), 600)
        return DECODE / (time.monotonic() - t0 - first)


def main() -> None:
    date = datetime.now(UTC).strftime("%Y-%m-%d")
    with tempfile.TemporaryDirectory() as tmp:
        directory = make(Path(tmp) / "deepseek-v3-small")
        kv = kv_rows(directory)
        decode = {"transformers generate (1 thread)": transformers_tps(directory),
                  "runtime, absorbed decode (default)": runtime_tps(directory, "decode"),
                  "runtime, plain form throughout": runtime_tps(directory, "never")}
    print(f"DeepSeek-V3 (MLA), float64, {platform.machine()}: KV cache bytes per token on one rank (4 layers)")
    print(f"| tp | measured from the cache | ledger | MHA of the same heads | GQA, {GQA_KV_HEADS} KV heads |")
    print("|---|---|---|---|---|")
    for r in kv:
        print(f"| {r['tp']} | {r['measuredBytesPerToken']} | {r['ledgerBytesPerToken']} | {r['mhaBytesPerToken']} "
              f"| {r['gqaBytesPerToken']} |")
    print(f"\ndecode tokens/s of one request after a {len(PROMPT)}-token prompt, {DECODE} decoded")
    print("| engine | decode tokens/s |")
    print("|---|---|")
    for name, tps in decode.items():
        print(f"| {name} | {tps:.1f} |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": f"{platform.machine()} {platform.python_version()}", "date": date,
                               "layers": 4, "promptTokens": len(PROMPT), "decodedTokens": DECODE,
                               "gqaKvHeads": GQA_KV_HEADS, "kv": kv, "decodeTokensPerSecond": decode},
                              indent=2) + "\n")
    print(f"\nwritten to {OUT}")


if __name__ == "__main__":
    main()
