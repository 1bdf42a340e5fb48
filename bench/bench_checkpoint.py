"""The reference runtime next to transformers on one Hugging Face checkpoint (part of `make bench-runtime`).

A random Qwen3-MoE checkpoint of about 9 million parameters made by transformers (4 layers, hidden 256, 8 query
and 4 KV heads, 8 experts of width 256, top-2, vocabulary 4096), float64 on this machine's CPUs. For
transformers' `generate` and for the runtime on 1, 2 (TP 2) and 4 (TP 2 x DPA 2) ranks, in one run: time to
first token of a 64-token prompt, and decode tokens/s of one request at a time (the same work for both); for the
runtime also 8 concurrent requests (continuous batching). Ratios are runtime over transformers.
"""

from __future__ import annotations

import json
import platform
import queue
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from checkpoints import builder, qwen3_moe_9m  # bench/checkpoints.py
from shardwise.agents.runtime.pool import LocalWorld

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "checkpoint.json"
PROMPT = list(range(10, 74))  # 64 tokens
DECODE, CONCURRENT = 32, 8




def transformers_figures(directory: Path) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # as one rank process runs
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float64,
                                                 experts_implementation="eager").eval()
    ids = torch.tensor([PROMPT])
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        t0 = time.monotonic()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        return time.monotonic() - t0

    gen(2)  # warm up
    ttft = min(gen(1) for _ in range(3))
    whole = gen(DECODE + 1)
    return ttft, DECODE / (whole - ttft)


def runtime_figures(directory: Path, layout: dict[str, Any]) -> tuple[float, float, float]:
    with LocalWorld({"generation": 1, "model": "bench", "weights_dir": str(directory), **layout}) as w:
        w.wait_ready(300)
        w.complete(PROMPT, 2)  # warm up
        ttfts = []
        for _ in range(3):
            first: queue.Queue[float] = queue.Queue()

            def on_event(kind: str, _value: Any, first: queue.Queue[float] = first) -> None:
                if kind == "token":
                    first.put(time.monotonic())

            t0 = time.monotonic()
            w.result(w.submit(PROMPT, 1, listener=on_event, stop_ids=()), 600)
            ttfts.append(first.get() - t0)
        ttft = min(ttfts)
        t0 = time.monotonic()
        w.result(w.submit(PROMPT, DECODE + 1, stop_ids=()), 600)
        single = DECODE / (time.monotonic() - t0 - ttft)
        t0 = time.monotonic()
        rids = [w.submit([*PROMPT[:60], i], DECODE, stop_ids=()) for i in range(CONCURRENT)]
        for r in rids:
            w.result(r, 600)
        batched = CONCURRENT * DECODE / (time.monotonic() - t0)
    return ttft, single, batched


def main() -> None:
    build = builder()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = qwen3_moe_9m(Path(tmp) / "qwen3-moe-8m")
        params = sum(p.numel() for p in build.transformers_model(directory).parameters())
        hf_ttft, hf_tps = transformers_figures(directory)
        rows.append({"what": "transformers generate (1 thread)", "ttftSeconds": hf_ttft,
                     "decodeTokensPerSecond": hf_tps})
        for name, layout in [("runtime, 1 rank", {"tp": 1, "dpa": 1, "pp": 1}),
                             ("runtime, 2 ranks (tp 2)", {"tp": 2, "dpa": 1, "pp": 1}),
                             ("runtime, 4 ranks (tp 2 x dpa 2, ep 4)", {"tp": 2, "dpa": 2, "pp": 1})]:
            ttft, single, batched = runtime_figures(directory, layout)
            rows.append({"what": name, "ttftSeconds": ttft, "decodeTokensPerSecond": single,
                         "concurrentTokensPerSecond": batched, "ttftRatio": ttft / hf_ttft,
                         "decodeRatio": single / hf_tps})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": f"{platform.machine()} {platform.python_version()}", "parameters": params,
                               "rows": rows}, indent=2) + "\n")
    print(f"Qwen3-MoE, {params / 1e6:.1f} M parameters, float64, prompt {len(PROMPT)} tokens, {DECODE} decoded")
    print("| engine | time to first token | decode tokens/s (1 request) | 8 concurrent "
          "| vs transformers (TTFT, decode) |")
    print("|---|---|---|---|---|")
    for r in rows:
        conc = f"{r['concurrentTokensPerSecond']:.1f}" if "concurrentTokensPerSecond" in r else "-"
        ratio = f"{r['ttftRatio']:.2f} x, {r['decodeRatio']:.2f} x" if "ttftRatio" in r else "1, 1"
        print(f"| {r['what']} | {r['ttftSeconds'] * 1000:.1f} ms | {r['decodeTokensPerSecond']:.1f} | {conc} "
              f"| {ratio} |")
    print(f"\nwritten to {OUT}")


if __name__ == "__main__":
    main()
