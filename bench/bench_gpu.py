"""The reference runtime on one GPU next to transformers on the same GPU (`make bench-gpu`).

On a machine with CUDA the rank selects NCCL on its GPU by itself (`select_device`); on one without, the same
script runs everything on the CPU (gloo), which is how it is checked before it meets a GPU. One rank, since one
GPU cannot hold an NCCL world of several ranks.

1. Tokens. Random Hugging Face checkpoints made by transformers (Qwen3-MoE and Llama with tied embeddings, the
   suite's small families), a few prompts, greedy decode of N tokens, in float64, float32 and bfloat16:
   the runtime's tokens against transformers' `generate` in the same dtype on the same device. float64 must be
   equal token for token. In float32 and bfloat16 the two compute in different orders (their own matmul, softmax
   and norm kernels), so a greedy decode may part at a near-tie; where it parts, transformers' float64 logits
   on the common prefix give the margin between the two choices (a near-tie has a small margin; a wrong kernel
   gives a large one).
2. Speed. A larger random Qwen3-MoE (bfloat16): time to first token of a 128-token prompt and decode tokens/s
   for 1 request and for 16 at once, the runtime against transformers' `generate` (batch 1 and 16).

Results go to bench/results/gpu.json (and to $OUT when that is set).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from checkpoints import builder  # bench/checkpoints.py
from shardwise.agents.runtime.pool import LocalWorld

OUT = Path(__file__).parent / "results" / "gpu.json"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# twelve prompts of 1 to 40 tokens (token ids: the checkpoints' vocabulary is 331)
PROMPTS = [[5, 17, 100, 42, 7, 250], [9], [3, 1, 4, 1, 5, 9, 2, 6], list(range(40, 72)),
           *[[(i * 53 + j * 29) % 320 + 5 for j in range(1 + (i * 7) % 40)] for i in range(8)]]
N = 24
DTYPES = ("float64", "float32", "bfloat16")
SPEED_PROMPT = [(i * 37) % 30000 + 10 for i in range(128)]
DECODE, CONCURRENT = 64, 16


def hf_model(directory: Path, dtype: str, *, eager: bool = True) -> Any:
    """transformers' model on DEVICE; `eager` experts (a loop over experts, as the runtime's) unless told: the
    default grouped_mm refuses float64."""
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
    if eager:
        kwargs["experts_implementation"] = "eager"
    try:
        model = AutoModelForCausalLM.from_pretrained(str(directory), **kwargs)
    except TypeError:  # a transformers without the keyword: its config attribute instead
        kwargs.pop("experts_implementation", None)
        model = AutoModelForCausalLM.from_pretrained(str(directory), **kwargs)
        model.config._experts_implementation = "eager" if eager else model.config._experts_implementation
    return model.to(DEVICE).eval()


def hf_greedy(model: Any, prompt: list[int], n: int, *, force: bool = False) -> list[int]:
    ids = torch.tensor([prompt], device=DEVICE)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, **({"min_new_tokens": n} if force else {}))
    return [int(t) for t in out[0, len(prompt):]]


def margin(model64: Any, prefix: list[int], a: int, b: int) -> float:
    """float64 logit of `a` minus that of `b` after `prefix` (transformers): how near a tie the parting was."""
    with torch.no_grad():
        logits = model64(torch.tensor([prefix], device=DEVICE)).logits[0, -1]
    return float(logits[a] - logits[b])


def runtime_tokens(family: str, directory: Path, dtype: str) -> tuple[list[list[int]], dict[str, Any]]:
    with LocalWorld({"generation": 1, "model": family, "weights_dir": str(directory), "tp": 1, "dpa": 1, "pp": 1,
                     "dtype": dtype}) as world:
        world.wait_ready(300)
        rids = [world.submit(p, N) for p in PROMPTS]  # in flight together: continuous batching
        got = [world.result(r, 300)["token_ids"] for r in rids]
        return got, world.stats()[0]


def token_rows(build: Any, tmp: Path) -> list[dict[str, Any]]:
    rows = []
    for family in ("qwen3_moe", "llama"):
        directory = build.make_checkpoint(tmp / family, family)
        model64 = hf_model(directory, "float64")
        exact = [hf_greedy(model64, p, N) for p in PROMPTS]
        for dtype in DTYPES:
            row: dict[str, Any] = {"family": family, "dtype": dtype}
            try:
                got, stats = runtime_tokens(family, directory, dtype)
                model = model64 if dtype == "float64" else hf_model(directory, dtype)
                want = exact if dtype == "float64" else [hf_greedy(model, p, N) for p in PROMPTS]
                parted = []
                for p, g, w in zip(PROMPTS, got, want, strict=True):
                    same = next((i for i, (x, y) in enumerate(zip(g, w, strict=False)) if x != y), min(len(g), len(w)))
                    if g != w and same < min(len(g), len(w)):
                        parted.append({"at": same, "margin": margin(model64, p + w[:same], w[same], g[same])})
                    elif g != w:
                        parted.append({"at": same, "margin": None})  # one stopped (EOS) where the other went on
                row |= {"equal": sum(g == w for g, w in zip(got, want, strict=True)), "prompts": len(PROMPTS),
                        "tokensEqual": _agree(got, want),
                        "tokens": sum(len(w) for w in want), "parted": parted,
                        # how far each stays with the exact (float64) answer before its own rounding parts it
                        "runtimeWithFloat64": _agree(got, exact), "transformersWithFloat64": _agree(want, exact),
                        "rankDevice": stats.get("device"), "backend": stats.get("backend")}
            except Exception as e:  # a bench reports each case's failure and goes on
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _agree(a: list[list[int]], b: list[list[int]]) -> int:
    """Tokens equal before the first difference, summed over the prompts."""
    total = 0
    for x, y in zip(a, b, strict=True):
        total += next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y)))
    return total


def speed_checkpoint(build: Any, directory: Path) -> Path:
    """A random Qwen3-MoE of about 385 M parameters: 6 layers, hidden 1024, 16 query and 4 KV heads of 64,
    32 experts of width 512, top-4, vocabulary 32,768."""
    return Path(build.make_checkpoint(
        directory, "qwen3_moe", vocab_size=32768, hidden_size=1024, intermediate_size=2048,
        moe_intermediate_size=512, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
        num_experts=32, num_experts_per_tok=4, max_position_embeddings=4096))


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def speed_rows(build: Any, tmp: Path) -> list[dict[str, Any]]:
    directory = speed_checkpoint(build, tmp / "speed")
    rows: list[dict[str, Any]] = []
    model = hf_model(directory, "bfloat16", eager=False)  # transformers' fastest experts
    params = sum(p.numel() for p in model.parameters())

    def hf_time(batch: int, n: int) -> float:
        ids = torch.tensor([[*SPEED_PROMPT[:-1], i + 1] for i in range(batch)], device=DEVICE)
        sync()
        t0 = time.monotonic()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)
        sync()
        return time.monotonic() - t0

    hf_time(1, 4)  # warm up
    ttft = min(hf_time(1, 1) for _ in range(3))
    single = DECODE / (hf_time(1, DECODE + 1) - ttft)
    batched = CONCURRENT * DECODE / hf_time(CONCURRENT, DECODE)
    rows.append({"what": "transformers generate", "ttftSeconds": ttft, "decodeTokensPerSecond": single,
                 "concurrentTokensPerSecond": batched})
    with LocalWorld({"generation": 1, "model": "speed", "weights_dir": str(directory), "tp": 1, "dpa": 1, "pp": 1,
                     "dtype": "bfloat16"}) as w:
        w.wait_ready(300)
        w.result(w.submit(SPEED_PROMPT, 4, stop_ids=()), 300)  # warm up
        ttfts = []
        for _ in range(3):
            t0 = time.monotonic()
            w.result(w.submit(SPEED_PROMPT, 1, stop_ids=()), 300)
            ttfts.append(time.monotonic() - t0)
        ttft = min(ttfts)
        t0 = time.monotonic()
        w.result(w.submit(SPEED_PROMPT, DECODE + 1, stop_ids=()), 300)
        single = DECODE / (time.monotonic() - t0 - ttft)
        t0 = time.monotonic()
        rids = [w.submit([*SPEED_PROMPT[:-1], i + 1], DECODE, stop_ids=()) for i in range(CONCURRENT)]
        for r in rids:
            w.result(r, 300)
        batched = CONCURRENT * DECODE / (time.monotonic() - t0)
        stats = w.stats()[0]
    rows.append({"what": "runtime, 1 rank", "ttftSeconds": ttft, "decodeTokensPerSecond": single,
                 "concurrentTokensPerSecond": batched, "rankDevice": stats.get("device"),
                 "backend": stats.get("backend")})
    for r in rows:
        r["parameters"] = params
        print(json.dumps(r), flush=True)
    return rows


def machine() -> str:
    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "no GPU"
    return f"{gpu}; torch {torch.__version__}; {platform.machine()} Python {platform.python_version()}"


def report(result: dict[str, Any]) -> None:
    print(f"\n{result['machine']}")
    print("| checkpoint | dtype | prompts equal | tokens equal before parting | where they part (float64 margin) "
          "| with float64's tokens: runtime / transformers |")
    print("|---|---|---|---|---|---|")
    for r in result["tokens"]:
        if "error" in r:
            print(f"| {r['family']} | {r['dtype']} | error: {r['error']} | | | |")
            continue
        parts = ", ".join(f"token {p['at']} ({p['margin']:.3g})" if p["margin"] is not None else f"token {p['at']}"
                          for p in r["parted"]) or "-"
        print(f"| {r['family']} | {r['dtype']} | {r['equal']} of {r['prompts']} | {r['tokensEqual']} of "
              f"{r['tokens']} | {parts} | {r['runtimeWithFloat64']} / {r['transformersWithFloat64']} |")
    if result.get("speed"):
        print(f"\nQwen3-MoE {result['speed'][0]['parameters'] / 1e6:.0f} M parameters, bfloat16, prompt "
              f"{len(SPEED_PROMPT)} tokens, {DECODE} decoded")
        print(f"| engine | time to first token | decode tokens/s (1 request) | {CONCURRENT} at once |")
        print("|---|---|---|---|")
        for r in result["speed"]:
            print(f"| {r['what']} | {r['ttftSeconds'] * 1000:.1f} ms | {r['decodeTokensPerSecond']:.1f} | "
                  f"{r['concurrentTokensPerSecond']:.1f} |")


def main() -> None:
    build = builder()
    result: dict[str, Any] = {"machine": machine(), "device": DEVICE}
    print(result["machine"], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        result["tokens"] = token_rows(build, Path(tmp))
        if "--tokens-only" not in sys.argv:
            try:
                result["speed"] = speed_rows(build, Path(tmp))
            except Exception as e:  # the token rows are still worth writing
                result["speedError"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
    for path in [OUT] + ([Path(os.environ["OUT"]) / "gpu.json"] if os.environ.get("OUT") else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
    report(result)


if __name__ == "__main__":
    main()
