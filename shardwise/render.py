"""Rich tables for the CLI: plans, searches and presets."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from shardwise.layout_search import SearchResult
from shardwise.planner import Plan
from shardwise.presets import GPU_PRESETS, MODEL_PRESETS

GiB = 1024**3


def _console() -> Console:
    return Console(width=max(Console().width, 150), highlight=False)


def size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def seconds(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.2f} us"


def _groups_line(groups: list[list[int]], limit: int = 6) -> str:
    shown = " ".join("{" + ",".join(map(str, g)) + "}" for g in groups[:limit])
    return shown + (f" ... ({len(groups)} groups)" if len(groups) > limit else "")


def plan_table(plan: Plan, name: str) -> None:
    con = _console()
    par = plan.spec.parallelism
    status = "[green]valid[/green]" if plan.valid else "[red]invalid[/red]"
    gpu = plan.gpu.name if plan.gpu else plan.spec.hardware.gpu
    con.print(f"[bold]{name}[/bold]: {plan.model_name} on {gpu} -- {status}")
    dense = plan.arch is not None and not plan.arch.is_moe
    experts = "dense, no experts" if dense else f"ep {par.ep_size}, moeTp {par.moe_tp}"
    con.print(
        f"world {plan.world_size} = pp {par.pp} x dpa {par.dpa} x cp {par.cp} x tp {par.tp}; "
        f"{experts}; {plan.pod_count} pod(s) of {plan.gpus_per_pod} GPU(s)"
    )
    for v in plan.warnings:
        con.print(f"[yellow]warning[/yellow] {v.field}: {v.message}")
    if plan.grid is not None:
        t = Table(title="groups (global ranks)", show_header=True, title_justify="left")
        t.add_column("kind")
        t.add_column("groups")
        alone = []
        for kind, groups in plan.groups().items():
            if dense and kind in ("ep", "moeTp"):
                continue
            if all(len(g) == 1 for g in groups):
                alone.append(kind)
            else:
                t.add_row(kind, _groups_line(groups))
        if alone:  # size-1 groups: the dimension is not used; one line says so instead of a row of singletons
            t.add_row(", ".join(alone), f"1 rank each ({plan.world_size} groups): not split")
        con.print(t)
    if plan.stage_ledger:
        t = Table(title="memory ledger per rank", title_justify="left")
        for col in ("stage", "layers", "weights", "activations", "workspace", "KV cache", "KV/token",
                    "total", "budget", "KV tokens", "requests"):
            t.add_column(col, justify="right")
        for i, e in enumerate(plan.stage_ledger):
            r = plan.stage_layers[i]
            t.add_row(str(i), f"{r.start}-{r.stop - 1}", size(e.weights_bytes), size(e.activation_bytes),
                      size(e.workspace_bytes), size(e.kv_cache_bytes), size(e.kv_bytes_per_token),
                      size(e.total_bytes), size(e.budget_bytes), f"{e.kv_capacity_tokens:,}",
                      f"{e.kv_capacity_requests:,}")
        con.print(t)
        cap = plan.capacity()
        con.print(f"KV capacity: {cap['requestsPerDpaGroup']:,} requests of maxModelLen="
                  f"{plan.max_model_len} per attention group, {cap['requests']:,} in all")
    if plan.stage_traffic:
        d = plan.to_dict()
        tr, est, w = d["traffic"], d["estimates"], plan.workload
        t = Table(title=f"one {w.phase.value} step, batch {w.batch} per group, context {w.context}",
                  title_justify="left")
        t.add_column("quantity")
        t.add_column("per rank", justify="right")
        t.add_row("TP AllReduce sent", f"{size(tr['tpAllReduceBytesPerRank'])} x {tr['tpAllReducesPerStep']}")
        t.add_row("EP all-to-all sent", f"{size(tr['epAllToAllBytesPerRank'])} x {tr['epAllToAllsPerStep']}")
        t.add_row("CP sent per layer", f"{size(tr['cpBytesPerRank'])} x {tr['cpOpsPerStep']}")
        t.add_row("PP send", size(tr["ppSendBytesPerRank"]))
        t.add_row("compute bound", seconds(est["computeSeconds"]))
        t.add_row("memory bound", seconds(est["memorySeconds"]))
        t.add_row("communication", seconds(est["commSeconds"]))
        t.add_row("step estimate", seconds(est["stepSeconds"]))
        t.add_row("tokens/s per GPU", f"{est['tokensPerSecondPerGpu']:,.1f}")
        t.add_row("tokens/s per user", f"{est['tokensPerSecondPerUser']:,.1f}")
        con.print(t)


def search_table(result: SearchResult, model: str, gpu: str, gpus: int, context: int) -> None:
    con = _console()
    con.print(f"[bold]{model}[/bold] on {gpus} x {gpu}, decode at context {context}: "
              f"{result.layouts_valid} valid of {result.layouts_tried} layouts, {len(result.points)} points")
    t = Table(title="Pareto front (tokens/s per GPU vs tokens/s per user)", title_justify="left")
    for col in ("#", "layout", "batch/group", "step", "tok/s/GPU", "tok/s/user", "KV requests"):
        t.add_column(col, justify="right")
    for i, p in enumerate(result.front, 1):
        t.add_row(str(i), p.layout(), str(p.batch), seconds(p.step_seconds), f"{p.tokens_per_second_per_gpu:,.1f}",
                  f"{p.tokens_per_second_per_user:,.1f}", f"{p.kv_capacity_requests:,}")
    con.print(t)
    con.print("write row N as a deployment: the same command with -o manifest --pick N")


def presets_table() -> None:
    con = _console()
    t = Table(title="model presets", title_justify="left")
    for col in ("name", "layers", "hidden", "attention", "heads/kv", "experts/top-k", "vocab"):
        t.add_column(col)
    for name, a in MODEL_PRESETS.items():
        heads = f"{a.num_heads}/{a.kv_heads}" if a.attention_type.value != "mla" else f"{a.num_heads}/latent"
        experts = f"{a.num_experts}/{a.top_k}" if a.is_moe else "dense"
        t.add_row(name, str(a.num_layers), str(a.hidden_size), a.attention_type.value, heads, experts,
                  str(a.vocab_size))
    con.print(t)
    t = Table(title="GPU presets", title_justify="left")
    for col in ("name", "memory", "HBM", "BF16", "NVLink (bidir.)", "GPUs/node"):
        t.add_column(col)
    for g in GPU_PRESETS.values():
        t.add_row(g.name, size(g.memory_bytes), f"{g.hbm_bandwidth / 1e12:g} TB/s",
                  f"{g.peak_flops / 1e12:g} TFLOPS", f"{g.nvlink_bandwidth / 1e9:g} GB/s",
                  str(g.default_gpus_per_node))
    con.print(t)
