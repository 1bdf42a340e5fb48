"""`make bench-context`: context parallelism in the reference runtime on this machine's CPUs.

A random Qwen3 (dense) checkpoint made by transformers (4 layers, hidden 256, 8 query and 4 KV heads of 64),
float64, CP = 2 over the 2 cores. Prefill CP: time to first token of a 512-token prompt for each layout, and the
causal work each rank computed (query-key pairs, from the ranks' own counters) against the planner's
`shardwise.cp.causal_work`. Decode CP: the time of a decode step and the bytes each rank sent per layer for ag_rs
and a2a, next to the planner's formulas.
"""

from __future__ import annotations

import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

from checkpoints import builder  # bench/checkpoints.py
from shardwise.agents.runtime.pool import LocalWorld

from shardwise import cost
from shardwise.api import CpLayout
from shardwise.checkpoint import inspect
from shardwise.cp import causal_work

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "results" / "context.json"
CP, PROMPT, DECODE = 2, list(range(1, 513)), 16




def world(directory: Path, **cp: str) -> LocalWorld:
    w = LocalWorld({"generation": 1, "model": "bench", "weights_dir": str(directory), "tp": 1, "dpa": 1, "pp": 1,
                    "cp": CP, "max_model_len": 1024, "max_batch_tokens": 1024, **cp})
    w.wait_ready(300)
    w.result(w.submit(PROMPT[:8], 2, stop_ids=()), 600)  # warm up
    return w


def main() -> None:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = builder().make_checkpoint(
            Path(tmp) / "qwen3-dense", "qwen3", tokenizer=False, vocab_size=1024, hidden_size=256,
            intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
            max_position_embeddings=2048)
        arch = inspect(directory).architecture
        for layout in ("contiguous", "zigzag", "striped"):
            with world(directory, cp_mode="pcp", cp_layout=layout) as w:
                before = {s["rank"]: s["cpWork"] for s in w.stats()}
                times = []
                for _ in range(3):
                    t0 = time.monotonic()
                    w.result(w.submit(PROMPT, 1, stop_ids=()), 600)
                    times.append(time.monotonic() - t0)
                work = [(s["cpWork"] - before[s["rank"]]) // (3 * arch.num_heads * arch.num_layers)
                        for s in sorted(w.stats(), key=lambda s: s["rank"])]
            rows.append({"what": f"pcp {layout}: prefill of {len(PROMPT)} tokens", "seconds": min(times),
                         "workPerRank": work, "plannerWork": causal_work(len(PROMPT), CP, CpLayout(layout))})
        for comm in ("ag_rs", "a2a"):
            with world(directory, cp_mode="dcp", cp_comm=comm) as w:
                before = [s["cpBytes"] for s in sorted(w.stats(), key=lambda s: s["rank"])]
                t0 = time.monotonic()
                w.result(w.submit(PROMPT[:64], 1, stop_ids=()), 600)
                prefill = time.monotonic() - t0
                t0 = time.monotonic()
                w.result(w.submit(PROMPT[:64], 1 + DECODE, stop_ids=()), 600)
                step = (time.monotonic() - t0 - prefill) / DECODE
                after = [s["cpBytes"] for s in sorted(w.stats(), key=lambda s: s["rank"])]
            steps = 2 * 1 + DECODE  # two prefills of 64 tokens and DECODE one-token steps, per layer
            keys = ("q", "o") if comm == "ag_rs" else ("o", "lse")  # what each formula counts (ag_rs: no LSE)
            sent = sum(a[k] - b[k] for a, b in zip(after, before, strict=True) for k in keys) // CP
            tokens = 64 * 2 + DECODE
            formula = (cost.dcp_send_bytes if comm == "ag_rs" else cost.dcp_a2a_send_bytes)(arch, 1, CP, tokens, 8)
            rows.append({"what": f"dcp {comm}: decode step", "seconds": step,
                         "bytesPerRankPerLayer": sent / arch.num_layers, "plannerBytesPerLayer": formula,
                         "steps": steps})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": f"{platform.machine()} {platform.python_version()}", "cp": CP,
                               "rows": rows}, indent=2) + "\n")
    print("| measurement | time | per rank | planner |")
    print("|---|---|---|---|")
    for r in rows:
        if "workPerRank" in r:
            print(f"| {r['what']} | {r['seconds'] * 1000:.0f} ms | work {r['workPerRank']} | {r['plannerWork']} |")
        else:
            print(f"| {r['what']} | {r['seconds'] * 1000:.1f} ms | {r['bytesPerRankPerLayer']:.0f} bytes per layer "
                  f"| {r['plannerBytesPerLayer']} bytes per layer |")
    print(f"\nwritten to {OUT}")


if __name__ == "__main__":
    main()
