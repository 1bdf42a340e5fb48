"""`make bench-plan`: how long planning and layout search take (figures go into the README).

Targets (issue 2): planning DeepSeek-V3 on 256 H200 under 50 ms; `--search` over every layout of 64 GPUs
under 2 s, on a 2-core machine.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from shardwise.api import InferenceDeploymentSpec
from shardwise.layout_search import search
from shardwise.planner import plan

OUT = Path(__file__).parent / "results" / "plan.json"


def timed(fn: Any, repeat: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def main() -> None:
    rows: list[dict[str, Any]] = []
    for model, dtype, tp, dpa, pp, redundant in [("DeepSeek-V3", "fp8", 1, 256, 1, 0),
                                                 ("DeepSeek-V3", "bfloat16", 8, 16, 2, 0),
                                                 ("Qwen3-235B-A22B", "bfloat16", 4, 64, 1, 128)]:
        spec = InferenceDeploymentSpec.model_validate({
            "model": {"preset": model, "dtype": dtype}, "hardware": {"gpu": "H200"},
            "parallelism": {"tp": tp, "dpa": dpa, "pp": pp}, "elastic": {"maxDpa": 1024},
            "eplb": {"redundantExperts": redundant},
        })
        secs, p = timed(lambda spec=spec: plan(spec), 50)
        secs_json, _ = timed(lambda p=p: json.dumps(p.to_dict()), 20)
        assert p.valid, [str(e) for e in p.errors]
        rows.append({"what": f"plan {model} {dtype} tp={tp} dpa={dpa} pp={pp} on {p.world_size} H200",
                     "seconds": secs, "withJsonSeconds": secs + secs_json, "valid": p.valid, "target": 0.05})
    for model in ("DeepSeek-V3", "Qwen3-235B-A22B", "Llama-3.1-405B"):
        secs, r = timed(lambda model=model: search(model, "H200", 64), 3)
        rows.append({"what": f"search {model} on 64 H200 ({r.layouts_tried} layouts, {len(r.points)} points)",
                     "seconds": secs, "target": 2.0})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": f"{platform.machine()} {platform.python_version()}", "rows": rows},
                              indent=2) + "\n")
    print("| benchmark | median | target |")
    print("|---|---|---|")
    for r in rows:
        extra = f" ({r['withJsonSeconds'] * 1e3:.1f} ms with JSON)" if "withJsonSeconds" in r else ""
        print(f"| {r['what']} | {r['seconds'] * 1e3:.1f} ms{extra} | < {r['target'] * 1e3:.0f} ms |")
    print(f"\nwritten to {OUT}")


if __name__ == "__main__":
    main()
