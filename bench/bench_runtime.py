"""`make bench-runtime`: the reference runtime on this machine's CPUs (gloo), tiny-moe, float64.

For 1, 2 and 4 ranks: decode throughput with 16 concurrent requests, and the cold start of the world (spawn,
import, load weights, rendezvous) as the yardstick. Then on a 2-rank world: one expert migration (all layers,
per layer), and the pause of a 2 -> 4 world change in the same processes, next to a 4-rank cold start.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
from shardwise.agents.runtime.pool import LocalWorld

OUT = Path(__file__).parent / "results" / "runtime.json"
REQUESTS, TOKENS = 16, 32


def cold_start(args: dict[str, Any]) -> tuple[LocalWorld, float]:
    t0 = time.monotonic()
    w = LocalWorld({"generation": 1, "model": "tiny-moe", **args})
    w.wait_ready(300)
    return w, time.monotonic() - t0


def throughput(w: LocalWorld) -> float:
    w.complete("warm up", 4)
    t0 = time.monotonic()
    rids = [w.submit(f"request {i}", TOKENS) for i in range(REQUESTS)]
    for r in rids:
        w.result(r, 600)
    return REQUESTS * TOKENS / (time.monotonic() - t0)


def main() -> None:
    rows: list[dict[str, Any]] = []
    worlds = [("1 rank", {"tp": 1, "dpa": 1, "pp": 1}), ("2 ranks (dpa=2, ep=2)", {"tp": 1, "dpa": 2, "pp": 1}),
              ("4 ranks (tp=2, dpa=2, ep=4)", {"tp": 2, "dpa": 2, "pp": 1})]
    for name, args in worlds:
        w, cold = cold_start(args)
        with w:
            rows.append({"what": f"decode throughput, {name}", "value": throughput(w), "unit": "tokens/s",
                         "coldStartSeconds": cold})
    w, cold2 = cold_start({"tp": 1, "dpa": 2, "pp": 1, "redundant_experts": 2})
    with w:
        rng = np.random.default_rng(0)
        target = {layer: rng.permutation([*range(16), 3, 5]).tolist() for layer in range(4)}
        moved, nbytes, seconds = w.migrate(1, target)
        rows.append({"what": f"migrate experts, per layer ({moved} copies, {nbytes / 1e6:.2f} MB in 4 layers)",
                     "value": seconds / 4, "unit": "s", "coldStartSeconds": cold2})
        rids = [w.submit(f"in flight {i}", 64) for i in range(4)]
        t0 = time.monotonic()
        pause = w.change_world(4, redundant_experts=4)
        whole = time.monotonic() - t0
        for r in rids:
            w.result(r, 600)
    _, cold4 = cold_start({"tp": 1, "dpa": 4, "pp": 1, "redundant_experts": 4})
    _.close()
    rows.append({"what": "world change 2 -> 4 ranks: pause (stop-the-world)", "value": pause, "unit": "s",
                 "coldStartSeconds": cold4})
    rows.append({"what": "world change 2 -> 4 ranks: whole (prepare + pause)", "value": whole, "unit": "s",
                 "coldStartSeconds": cold4})
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"machine": f"{platform.machine()} {platform.python_version()}", "rows": rows},
                              indent=2) + "\n")
    print("| measurement | value | cold start of the same world | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        ratio = f"{r['value'] / r['coldStartSeconds']:.2f}" if r["unit"] == "s" else "-"
        print(f"| {r['what']} | {r['value']:.3g} {r['unit']} | {r['coldStartSeconds']:.2f} s | {ratio} |")
    print(f"\nwritten to {OUT}")


if __name__ == "__main__":
    main()
