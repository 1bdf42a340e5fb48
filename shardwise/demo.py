"""`make demo` until the local cluster exists: plan every example deployment and print its plan, then
search the layouts of one model on 64 GPUs."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from shardwise import render
from shardwise.api import parse_deployment
from shardwise.layout_search import search
from shardwise.planner import plan


def main(examples: Path = Path("examples")) -> int:
    import yaml

    con = Console(width=150, highlight=False)
    files = sorted(examples.glob("*.yaml"))
    invalid = 0
    for i, path in enumerate(files, 1):
        con.rule(f"[bold]{i}/{len(files)}  shardwise plan {path}")
        dep = parse_deployment(yaml.safe_load(path.read_text()))
        result = plan(dep.spec)
        render.plan_table(result, dep.metadata.name or path.stem)
        invalid += not result.valid
    con.rule("[bold]shardwise plan --search --model Qwen3-235B-A22B --gpu H200 --gpus 64")
    render.search_table(search("Qwen3-235B-A22B", "H200", 64), "Qwen3-235B-A22B", "H200", 64, 4096)
    return 1 if invalid else 0


if __name__ == "__main__":
    raise SystemExit(main())
