"""The `shardwise` command: one entry point, subcommands imported lazily.

Exit codes: 0 success (a valid plan), 2 an invalid spec (one message per violation on stderr), 1 bad usage
(unreadable file, unknown preset, wrong flags: a one-line message, no traceback).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

import click

from shardwise import envvars

EXIT_INVALID = 2
EXIT_USAGE = 1


class UsageFailure(Exception):
    """Bad usage: reported as one line, exit code 1."""


class SpecInvalid(Exception):
    """An invalid spec: one line per violation, exit code 2."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines = lines


MAX_MANIFEST_BYTES = 1 << 20  # the API server's own limit on an object
MAX_ALIASES = 64  # YAML aliases (*name) in one file: enough for anchors, too few for an expansion bomb


def load_manifest(path: Path) -> dict[str, Any]:
    """The one InferenceDeployment document of a YAML file (other kinds beside it are ignored; two or more
    InferenceDeployments are refused, to be planned one at a time)."""
    import yaml

    try:
        raw = path.read_bytes()
    except OSError as e:
        raise UsageFailure(f"cannot read {path}: {e.strerror or e}") from e
    if len(raw) > MAX_MANIFEST_BYTES:
        raise UsageFailure(f"{path} has {len(raw):,} bytes; a manifest is at most {MAX_MANIFEST_BYTES:,} "
                           "(the API server's object limit)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageFailure(f"{path} is not UTF-8 text: byte 0x{raw[e.start]:02x} at offset {e.start}") from e
    try:
        aliases = sum(isinstance(t, yaml.AliasToken) for t in yaml.scan(text, Loader=yaml.SafeLoader))
        if aliases > MAX_ALIASES:
            raise UsageFailure(f"{path} uses {aliases} YAML aliases; at most {MAX_ALIASES} are accepted")
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise UsageFailure(f"{path} is not valid YAML: {str(e).splitlines()[0][:200]}") from e
    found = [(i, d) for i, d in enumerate(docs, 1) if isinstance(d, dict) and d.get("kind") == "InferenceDeployment"]
    if len(found) > 1:
        raise UsageFailure(f"{path} holds {len(found)} InferenceDeployments (documents "
                           f"{', '.join(str(i) for i, _ in found)}): plan one file per deployment")
    if not found:
        raise UsageFailure(f"{path} holds no document of kind InferenceDeployment")
    return found[0][1]


def parse_spec(doc: dict[str, Any]) -> Any:
    """Validate a manifest; pydantic errors become SpecInvalid lines with YAML field paths."""
    from pydantic import ValidationError

    from shardwise.api import parse_deployment

    try:
        return parse_deployment(doc)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith("function-"))
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = "unknown field" + _did_you_mean(err["loc"])
            got = repr(err["input"])
            got = got if len(got) <= 80 else got[:77] + "..."
            lines.append(f"{loc}: {msg}" + (f" (got {got})" if err["type"] != "missing"
                                             and not isinstance(err["input"], dict) else ""))
        raise SpecInvalid(lines) from e


def _did_you_mean(loc: tuple[int | str, ...]) -> str:
    """`; did you mean 'gpusPerNode'?` for a misspelled field, from the fields the model has at that place."""
    import difflib
    import typing

    from pydantic import BaseModel

    from shardwise.api import InferenceDeployment

    model: Any = InferenceDeployment
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        fields = {f.alias or n: f for n, f in model.model_fields.items()}
        if part not in fields:
            return ""
        kinds = [fields[part].annotation, *typing.get_args(fields[part].annotation)]
        kinds += [a for k in kinds for a in typing.get_args(k)]  # list[Toleration], X | None
        model = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
        if model is None:
            return ""
    known = [f.alias or n for n, f in model.model_fields.items()]
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    close = close or [k for k in known if k.lower() == str(loc[-1]).lower().replace("_", "")]
    return f"; did you mean {close[0]!r}?" if close else f"; {model.__name__} fields: {', '.join(known)}"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="shardwise")
def cli() -> None:
    """shardwise: elastic LLM inference on Kubernetes, with layouts checked against the model."""


_SEARCH_ONLY = ("model", "gpu", "gpus", "gpus_per_node", "pick", "name")
_FILE_ONLY = ("batch", "phase", "diagram")


def _given(ctx: click.Context, names: tuple[str, ...]) -> list[str]:
    """The options among `names` the user set (on the command line or in the environment)."""
    from click.core import ParameterSource

    flags = {p.name: p.opts[0] for p in ctx.command.params if p.name}
    return [flags[n] for n in names if ctx.get_parameter_source(n) not in (None, ParameterSource.DEFAULT)]


def _listed(flags: list[str], one: str, many: str) -> str:
    return f"{', '.join(flags)} {one if len(flags) == 1 else many}"


@cli.command()
@click.argument("file", type=click.Path(path_type=Path), required=False)
@click.option("--batch", type=click.IntRange(min=1), default=64, show_default=True,
              help="Requests per attention group in the workload.")
@click.option("--context", type=click.IntRange(min=1), default=None,
              help="Decode: tokens in the KV cache; prefill: prompt length. Default min(4096, maxModelLen).")
@click.option("--phase", type=click.Choice(["decode", "prefill"]), default="decode", show_default=True)
@click.option("--output", "-o", type=click.Choice(["table", "json", "yaml", "manifest"]), default="table",
              show_default=True, help="manifest (--search only): the picked layout as an InferenceDeployment.")
@click.option("--diagram", type=click.Path(path_type=Path), default=None,
              help="Write a picture of the pods and groups (.svg or .png).")
@click.option("--search", is_flag=True, help="Search every valid layout of --model on --gpus x --gpu.")
@click.option("--model", default=None, help="--search: a model preset or a Hugging Face checkpoint directory.")
@click.option("--gpu", default=None, help="--search: GPU preset.")
@click.option("--gpus", type=click.IntRange(min=1), default=None, help="--search: number of GPUs.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=None, help="--search: GPUs per node.")
@click.option("--pick", type=click.IntRange(min=1), default=None,
              help="-o manifest: the row # of the Pareto front to write (default 1, the most tokens/s per GPU).")
@click.option("--name", default=None, help="-o manifest: metadata.name (default: from the model).")
@click.pass_context
def plan(
    ctx: click.Context, file: Path | None, batch: int, context: int | None, phase: str, output: str,
    diagram: Path | None, search: bool, model: str | None, gpu: str | None, gpus: int | None,
    gpus_per_node: int | None, pick: int | None, name: str | None,
) -> None:
    """Validate FILE's layout and show its plan: rank grid, pods, memory ledger, traffic, estimates.

    With --search, rank every valid layout of a model on N GPUs instead (a Pareto front of tokens/s per
    GPU against tokens/s per user); `-o manifest --pick N` writes row N as an InferenceDeployment to apply.
    """
    if search:
        if file is not None:
            raise UsageFailure("give either FILE or --search, not both")
        ignored = _given(ctx, _FILE_ONLY)
        if ignored:
            raise UsageFailure(f"{_listed(ignored, 'does', 'do')} not apply to --search (it plans decode at every "
                               "batch up to the KV capacity and draws no diagram)")
        missing = [n for n, v in (("--model", model), ("--gpu", gpu), ("--gpus", gpus)) if v is None]
        if missing:
            raise UsageFailure(f"--search needs {', '.join(missing)}")
        if output != "manifest" and (pick is not None or name is not None):
            raise UsageFailure(f"{_listed(_given(ctx, ('pick', 'name')), 'applies', 'apply')} only to -o manifest")
        assert model and gpu and gpus
        _search(model, gpu, gpus, gpus_per_node, context, output, pick or 1, name)
        return
    ignored = _given(ctx, _SEARCH_ONLY)
    if ignored:
        raise UsageFailure(f"{_listed(ignored, 'applies', 'apply')} only to --search")
    if output == "manifest":
        raise UsageFailure("-o manifest writes a layout found by --search; FILE is a manifest already")
    if file is None:
        raise UsageFailure("give a FILE.yaml to plan, or --search --model M --gpu G --gpus N")
    _plan_file(file, batch, context, phase, output, diagram)


def _plan_file(file: Path, batch: int, context: int | None, phase: str, output: str,
               diagram: Path | None) -> None:
    from shardwise import render
    from shardwise.cost import Phase, Workload
    from shardwise.planner import max_model_len, resolve
    from shardwise.planner import plan as make_plan

    dep = parse_spec(load_manifest(file))
    spec = dep.spec
    _, arch, _, unknown = resolve(spec)
    if unknown:
        raise UsageFailure(str(unknown[0]))
    w = Workload(Phase(phase), batch, context or min(4096, max_model_len(spec, arch)))
    result = make_plan(spec, w)
    name = dep.metadata.name or file.stem
    if output == "json":
        click.echo(json.dumps({"name": name, **result.to_dict()}, indent=2))
    elif output == "yaml":
        import yaml

        click.echo(yaml.safe_dump({"name": name, **result.to_dict()}, sort_keys=False), nl=False)
    else:
        render.plan_table(result, name)
    if diagram is not None and result.grid is not None:
        from shardwise.diagram import write

        try:
            write(result, diagram)
        except (ValueError, OSError) as e:
            raise UsageFailure(str(e)) from e
    refused = []
    if result.valid and spec.runtime.engine.value == "vllm":
        from shardwise import vllm

        refused = vllm.refusals(spec, result)  # what the operator's admission refuses for engine vllm
    if not result.valid or refused:
        raise SpecInvalid([str(v) for v in result.errors] + refused)


def _search(model: str, gpu: str, gpus: int, gpus_per_node: int | None, context: int | None, output: str,
            pick: int, name: str | None) -> None:
    from shardwise import render
    from shardwise.checkpoint import CheckpointError
    from shardwise.layout_search import search
    from shardwise.presets import UnknownPreset, gpu_preset, model_preset

    for flag, value, find in (("--model", model, model_preset), ("--gpu", gpu, gpu_preset)):
        try:
            if flag == "--gpu" or not Path(value).is_dir():
                find(value)
        except UnknownPreset as e:
            raise UsageFailure(f"{flag}: {e.message}") from e
    try:
        result = search(model, gpu, gpus, gpus_per_node=gpus_per_node, context=context)
    except CheckpointError as e:
        raise SpecInvalid([str(e)]) from e
    except ValueError as e:
        raise UsageFailure(str(e)) from e
    context = result.context
    if output == "manifest":
        _write_manifest(result, model, gpus, pick, name)
        return
    if output == "table":
        render.search_table(result, model, gpu, gpus, context)
        return
    data = {
        "model": model, "gpu": gpu, "gpus": gpus, "context": context,
        "layoutsTried": result.layouts_tried, "layoutsValid": result.layouts_valid,
        "front": [
            {"tp": p.tp, "dpa": p.dpa, "pp": p.pp, "cp": p.cp, "moeTp": p.moe_tp, "batch": p.batch,
             "stepSeconds": p.step_seconds, "tokensPerSecondPerGpu": p.tokens_per_second_per_gpu,
             "tokensPerSecondPerUser": p.tokens_per_second_per_user,
             "kvCapacityRequests": p.kv_capacity_requests}
            for p in result.front
        ],
    }
    if output == "json":
        click.echo(json.dumps(data, indent=2))
    else:
        import yaml

        click.echo(yaml.safe_dump(data, sort_keys=False), nl=False)


def _write_manifest(result: Any, model: str, gpus: int, pick: int, name: str | None) -> None:
    """Row `pick` of the front (ordered as the table shows it) as a manifest, planned again before it is
    written: what is printed is what admission accepts."""
    import yaml

    from shardwise.api import dns_label_error
    from shardwise.layout_search import deployment_name, manifest

    front = result.front
    if not front:
        raise SpecInvalid([f"no layout of {model} fits on {gpus} GPUs: nothing to write"])
    if pick > len(front):
        raise UsageFailure(f"--pick {pick}: the Pareto front has {len(front)} rows (1..{len(front)})")
    name = name if name is not None else deployment_name(model)
    problem = dns_label_error(name)
    if problem:
        raise UsageFailure(f"--name {name!r}: {problem}")
    point = front[pick - 1]
    doc = manifest(result, point, name)
    from shardwise.planner import plan as make_plan

    checked = make_plan(parse_spec(doc).spec)
    if not checked.valid:  # the search planned the same spec; a difference is a bug, not the user's
        raise SpecInvalid([str(v) for v in checked.errors])
    click.echo(f"# {point.layout()}: row {pick} of {len(front)} on the Pareto front, batch {point.batch} per group, "
               f"{point.tokens_per_second_per_gpu:,.1f} tokens/s per GPU, {point.tokens_per_second_per_user:,.1f} "
               "per user (estimates)")
    click.echo(yaml.safe_dump(doc, sort_keys=False), nl=False)


@cli.group()
def weights() -> None:
    """Model weights for the reference runtime."""


@weights.command("generate")
@click.option("--model", required=True, help="Model preset, e.g. tiny-moe.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.argument("directory", type=click.Path(path_type=Path))
def weights_generate(model: str, seed: int, directory: Path) -> None:
    """Write deterministic weights of MODEL as safetensors shards into DIRECTORY."""
    from shardwise.presets import UnknownPreset, model_preset

    try:
        arch = model_preset(model)
    except UnknownPreset as e:
        raise UsageFailure(e.message) from e
    from shardwise.agents.runtime import weights as w

    try:
        files = w.write(directory, model, arch, seed)
    except OSError as e:
        raise UsageFailure(f"cannot write {directory}: {e.strerror or e}") from e
    total = sum(f.stat().st_size for f in files)
    click.echo(f"wrote {len(files)} files, {total / 1024**2:.1f} MiB, to {directory}")


@cli.command()
@click.option("--model", default="tiny-moe", show_default=True,
              help="A model preset (the in-repo reference), or a Hugging Face checkpoint directory (transformers).")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--weights", "weights_dir", type=click.Path(path_type=Path, exists=True, file_okay=False),
              default=None, help="Presets: read seeded weights from this directory instead of generating them.")
@click.option("--prompt", default=None, help="Text (byte-level tokens after a BOS, or the checkpoint's tokenizer).")
@click.option("--prompt-ids", default=None, help="The prompt as token ids, e.g. 5,17,100.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=16, show_default=True)
def oracle(model: str, seed: int, weights_dir: Path | None, prompt: str | None, prompt_ids: str | None,
           max_tokens: int) -> None:
    """Greedy completion in one process with no parallelism; prints JSON {token_ids, text, finish_reason}.

    For a checkpoint directory this is transformers' own greedy decode in float64 on the CPU (an
    implementation nobody here wrote); for a preset, shardwise's single-process reference model."""
    from shardwise.presets import UnknownPreset

    if (prompt is None) == (prompt_ids is None):
        raise UsageFailure("give exactly one of --prompt and --prompt-ids")
    given: str | list[int]
    if prompt_ids is not None:
        try:
            given = [int(t) for t in prompt_ids.split(",") if t.strip()]
        except ValueError as e:
            raise UsageFailure(f"--prompt-ids wants comma-separated integers, got {prompt_ids!r}") from e
    else:
        assert prompt is not None
        given = prompt
    try:
        if Path(model).is_dir():
            from shardwise.agents.runtime.oracle import transformers_complete

            result = transformers_complete(Path(model), given, max_tokens)
        else:
            from shardwise.agents.runtime.oracle import complete

            result = complete(model, seed, given, max_tokens, weights_dir)
    except UnknownPreset as e:
        raise UsageFailure(f"--model: {e.message}, and no directory of that name") from e
    except ImportError as e:
        raise UsageFailure(f"the oracle needs torch and transformers: run `make install` ({e})") from e
    except ValueError as e:
        raise SpecInvalid([str(e)]) from e
    click.echo(json.dumps(result))


@cli.group()
def model() -> None:
    """Hugging Face checkpoints."""


@model.command("inspect")
@click.argument("directory", type=click.Path(path_type=Path))
def model_inspect(directory: Path) -> None:
    """Check a checkpoint directory and print the `model:` block of an InferenceDeployment serving it, with the
    architecture read from its config.json (for admission where the operator cannot read the files)."""
    from shardwise import checkpoint

    try:
        info = checkpoint.inspect(directory)
    except checkpoint.CheckpointError as e:
        raise SpecInvalid([str(e)]) from e
    import yaml

    arch = info.architecture.model_dump(mode="json", by_alias=True)
    block = {"model": {"source": {"path": str(directory.resolve())}, "dtype": info.dtype.value,
                       "architecture": arch}}
    params = sum(math.prod(t.shape) for t in info.tensors.values())
    click.echo(f"# {directory}: {info.model_type}, {params:,} parameters in {len(info.files)} file(s), "
               f"{'a' if info.has_tokenizer else 'no'} tokenizer, EOS {list(info.eos_token_ids)}")
    for line in checkpoint.mla_summary(info.architecture):
        click.echo(f"# {line}")
    click.echo(yaml.safe_dump(block, sort_keys=False), nl=False)


class _OwnEnvOption(click.Option):
    """An option read from its SHARDWISE_* variable unless the value is a Kubernetes service link's
    (`SHARDWISE_METRICS_PORT=tcp://10.96.0.7:9090` for a Service named shardwise-metrics): then the default holds."""

    def resolve_envvar_value(self, ctx: click.Context) -> str | None:
        value = super().resolve_envvar_value(ctx)
        return None if value is not None and envvars.is_service_link(value) else value


def _env(name: str) -> dict[str, Any]:
    return {"envvar": f"SHARDWISE_{name}", "show_envvar": True, "cls": _OwnEnvOption}


@cli.command()
@click.option("--engine", type=click.Choice(["reference", "vllm"]), default="reference",
              help="reference: the pod's ranks run shardwise's runtime; vllm: ENGINE_ARGS start vLLM's server, "
              "supervised by the agent.", **_env("ENGINE"))
@click.argument("engine_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--deployment", default="local", **_env("DEPLOYMENT"))
@click.option("--pod-index", type=click.IntRange(min=0), default=0, **_env("POD_INDEX"))
@click.option("--generation", type=click.IntRange(min=1), default=1, **_env("GENERATION"))
@click.option("--ranks", default="", help="Global ranks on this pod, e.g. 0,1 (empty: wait for Configure).",
              **_env("RANKS"))
@click.option("--world-size", type=click.IntRange(min=0), default=0, help="Checked against tp*dpa*pp.",
              **_env("WORLD_SIZE"))
@click.option("--rendezvous", default="", help="host:port of the deployment's TCPStore.", **_env("RENDEZVOUS"))
@click.option("--model", default="tiny-moe", **_env("MODEL"))
@click.option("--tp", type=click.IntRange(min=1), default=1, **_env("TP"))
@click.option("--dpa", type=click.IntRange(min=1), default=1, **_env("DPA"))
@click.option("--pp", type=click.IntRange(min=1), default=1, **_env("PP"))
@click.option("--redundant-experts", type=click.IntRange(min=0), default=0, **_env("REDUNDANT_EXPERTS"))
@click.option("--seed", type=click.IntRange(min=0), default=0, **_env("SEED"))
@click.option("--weights", default="", help="Weights directory (default: generate from the seed).",
              **_env("WEIGHTS"))
@click.option("--max-model-len", type=click.IntRange(min=1), default=4096, **_env("MAX_MODEL_LEN"))
@click.option("--max-running", type=click.IntRange(min=1), default=64,
              help="Requests a DPA group decodes at once; the rest wait in its queue.", **_env("MAX_RUNNING"))
@click.option("--served-model-name", default="", help="The OpenAI API's model name (default: --model).",
              **_env("SERVED_MODEL_NAME"))
@click.option("--dtype", type=click.Choice(["float64", "float32", "bfloat16", "float16"]), default="float64",
              help="What the ranks compute in, for a world given on the command line.", **_env("DTYPE"))
@click.option("--moe-tp", type=click.IntRange(min=1), default=1, help="Ranks that split each routed expert.",
              **_env("MOE_TP"))
@click.option("--cp", type=click.IntRange(min=1), default=1, help="Ranks that split each sequence.", **_env("CP"))
@click.option("--cp-mode", type=click.Choice(["pcp", "dcp"]), default="dcp", **_env("CP_MODE"))
@click.option("--cp-layout", type=click.Choice(["contiguous", "zigzag", "striped"]), default="striped",
              **_env("CP_LAYOUT"))
@click.option("--cp-comm", type=click.Choice(["ag_rs", "a2a"]), default="ag_rs", **_env("CP_COMM"))
@click.option("--host", default="127.0.0.1", help="Address to listen on (the pod IP).", **_env("POD_IP"))
@click.option("--grpc-port", type=click.IntRange(min=0), default=50051, **_env("GRPC_PORT"))
@click.option("--http-port", type=click.IntRange(min=0), default=8000, **_env("HTTP_PORT"))
@click.option("--metrics-port", type=click.IntRange(min=0), default=9090, **_env("METRICS_PORT"))
@click.option("--wait-for-configure/--configure-self", default=False,
              help="Wait for the operator's Configure call even when --ranks is given (the operator's pods).",
              **_env("WAIT_FOR_CONFIGURE"))
@click.option("--host-store/--no-host-store", default=False,
              help="Host the deployment's rendezvous store (pod 0 does); Describe reports its address.",
              **_env("HOST_STORE"))
@click.option("--store-port", type=click.IntRange(min=0), default=29500, help="Port of the hosted store.",
              **_env("STORE_PORT"))
@click.option("--expert-metrics", type=click.Choice(["aggregate", "per-expert"]), default="aggregate",
              help="aggregate: one expert-balance series per pod; per-expert: also one per logical expert and layer.",
              **_env("EXPERT_METRICS"))
def agent(engine: str, engine_args: tuple[str, ...], deployment: str, pod_index: int, generation: int, ranks: str,
          world_size: int, rendezvous: str,
          model: str, tp: int, dpa: int, pp: int, redundant_experts: int, seed: int, weights: str,
          max_model_len: int, max_running: int, served_model_name: str, dtype: str, moe_tp: int, cp: int,
          cp_mode: str, cp_layout: str, cp_comm: str, host: str, grpc_port: int,
          http_port: int, metrics_port: int, wait_for_configure: bool, host_store: bool, store_port: int,
          expert_metrics: str) -> None:
    """The node agent of a worker pod: its ranks, the gRPC API, completions (HTTP) and /metrics.

    With --engine vllm, `shardwise agent --engine vllm -- VLLM_ARGS` supervises vLLM's OpenAI server started with
    VLLM_ARGS (by the interpreter SHARDWISE_VLLM_PYTHON, default python3) and serves port 8000 in front of it.
    The agent token comes from SHARDWISE_AGENT_TOKEN (or the file named by SHARDWISE_AGENT_TOKEN_FILE).
    """
    if engine_args and engine != "vllm":
        raise UsageFailure(f"unexpected arguments {' '.join(engine_args)!r}: only --engine vllm takes ENGINE_ARGS")
    if engine == "vllm" and not engine_args:
        raise UsageFailure("--engine vllm needs vLLM's arguments after --, e.g. -- --model /models/m")
    try:
        local = tuple(int(r) for r in ranks.split(",") if r.strip())
    except ValueError as e:
        raise UsageFailure(f"--ranks wants comma-separated integers, got {ranks!r}") from e
    if world_size and world_size != tp * dpa * cp * pp:
        raise UsageFailure(f"--world-size {world_size} != tp*dpa*cp*pp = {tp * dpa * cp * pp}")
    if local and not rendezvous and not wait_for_configure:
        raise UsageFailure("--ranks needs --rendezvous host:port")
    if engine != "vllm":  # the forkserver imports torch for the ranks while this process imports the agent
        from shardwise.agents.runtime.warm import warm_rank_starts

        warm_rank_starts()
    from shardwise.agents.agent_main import AgentOptions, run, run_vllm
    from shardwise.agents.auth import AgentTokenError

    opts = AgentOptions(deployment=deployment, pod_index=pod_index, host=host, grpc_port=grpc_port,
                        http_port=http_port, metrics_port=metrics_port, generation=generation, ranks=local,
                        rendezvous=rendezvous, model=model, tp=tp, dpa=dpa, pp=pp,
                        redundant_experts=redundant_experts, seed=seed, weights=weights, max_model_len=max_model_len,
                        max_running=max_running, served_model_name=served_model_name, dtype=dtype, moe_tp=moe_tp,
                        cp=cp, cp_mode=cp_mode, cp_layout=cp_layout, cp_comm=cp_comm,
                        wait_for_configure=wait_for_configure,
                        host_store=host_store, store_port=store_port, expert_metrics=expert_metrics)
    try:
        code = run_vllm(opts, engine_args) if engine == "vllm" else run(opts)
    except AgentTokenError as e:
        raise UsageFailure(str(e)) from e
    if code:
        sys.exit(code)


@cli.command("run")
@click.option("--model", default="tiny-moe", show_default=True,
              help="A model preset, or a Hugging Face checkpoint directory.")
@click.option("--served-model-name", default="", help="The OpenAI API's model name (default: the directory's name).")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--dpa", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--pp", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--redundant-experts", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--agents", "num_agents", type=click.IntRange(min=1), default=1, show_default=True,
              help="Agents (simulated pods); the ranks are split evenly between them.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--weights", default="", help="Weights directory (default: generate from the seed).")
@click.option("--max-model-len", type=click.IntRange(min=1), default=None,
              help="Longest request in tokens (default: the model's max_position_embeddings, else 4096).")
@click.option("--dtype", type=click.Choice(["float64", "float32", "bfloat16", "float16"]), default="float64",
              show_default=True, help="What the ranks compute in (float64: every layout equals the oracle).")
@click.option("--moe-tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Ranks that split each routed expert (EP = dpa * cp * tp / moe-tp).")
@click.option("--cp", type=click.IntRange(min=1), default=1, show_default=True, help="Ranks that split each sequence.")
@click.option("--cp-mode", type=click.Choice(["pcp", "dcp"]), default="dcp", show_default=True)
@click.option("--cp-layout", type=click.Choice(["contiguous", "zigzag", "striped"]), default="striped",
              show_default=True)
@click.option("--cp-comm", type=click.Choice(["ag_rs", "a2a"]), default="ag_rs", show_default=True)
@click.option("--router-port", type=click.IntRange(min=0), default=0,
              help="Port of the router in front of the DPA groups (0: any free port; printed as `router URL`).")
def run_local(model: str, served_model_name: str, tp: int, dpa: int, pp: int, redundant_experts: int,
              num_agents: int, seed: int, weights: str, max_model_len: int | None, dtype: str, moe_tp: int, cp: int,
              cp_mode: str, cp_layout: str, cp_comm: str, router_port: int) -> None:
    """Run a deployment's agents and ranks on 127.0.0.1 without Kubernetes, until Ctrl-C or SIGTERM."""
    import signal
    import threading

    from shardwise.api import InferenceDeploymentSpec
    from shardwise.planner import plan as make_plan

    world = tp * dpa * cp * pp
    if world % num_agents:
        raise UsageFailure(f"world size {world} (tp*dpa*cp*pp) is not divisible by --agents {num_agents}")
    model_block: dict[str, Any] = {"preset": model, "dtype": dtype}
    if Path(model).is_dir():
        if weights:
            raise UsageFailure("--weights is for presets; --model already names a checkpoint directory")
        weights = str(Path(model).resolve())
        model, model_block = Path(weights).name, {"source": {"path": weights}, "dtype": dtype}
    spec = InferenceDeploymentSpec.model_validate({
        "model": model_block, "hardware": {"gpu": "cpu", "gpusPerNode": world // num_agents},
        "parallelism": {"tp": tp, "dpa": dpa, "pp": pp, "moeTp": moe_tp, "cp": cp, "cpMode": cp_mode,
                        "cpLayout": cp_layout, "cpComm": cp_comm},
        "serving": {"maxModelLen": max_model_len} if max_model_len else {},
        "eplb": {"redundantExperts": redundant_experts}, "elastic": {"maxDpa": max(dpa, 64)}})
    from shardwise.planner import resolve

    if resolve(spec)[3]:
        raise UsageFailure(resolve(spec)[3][0].message)
    checked = make_plan(spec)
    if not checked.valid:
        raise SpecInvalid([str(v) for v in checked.errors])
    from shardwise.agents.localrun import LocalDeployment

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    dep = LocalDeployment(model=model, tp=tp, dpa=dpa, pp=pp, agents=num_agents,
                          redundant_experts=redundant_experts, seed=seed, weights=weights,
                          max_model_len=checked.max_model_len, served_model_name=served_model_name or model,
                          dtype=dtype,
                          moe_tp=moe_tp, cp=cp, cp_mode=cp_mode, cp_layout=cp_layout, cp_comm=cp_comm,
                          log=lambda m: click.echo(m, err=True))
    from shardwise.agents import router as r

    front = None
    try:
        dep.start()
        for ap in dep.procs:
            click.echo(f"agent {ap.pod}: grpc {ap.grpc}  metrics {ap.metrics}")
        for url in dep.serving_urls():
            click.echo(f"serving {url}")
        # one address in front of the groups, as a deployment's router is
        front = r.start(r.Options(deployment="local", token=dep.token), "127.0.0.1", router_port)
        assert checked.grid is not None
        front.router.set_routes({"model": served_model_name or model, "groups": [
            {"group": g, "url": dep.procs[int(checked.grid.grid[0, g, 0, 0]) // dep.per_pod].http}
            for g in range(dpa)]})
        click.echo(f"router http://127.0.0.1:{front.port}")
        click.echo("ready", nl=True)
        sys.stdout.flush()
        stop.wait()
    except RuntimeError as e:
        raise UsageFailure(str(e)) from e
    finally:
        if front is not None:
            front.close()
        dep.stop()


@cli.command()
@click.option("--deployment", default="local", **_env("DEPLOYMENT"))
@click.option("--host", default="127.0.0.1", help="Address to listen on (the pod IP).", **_env("POD_IP"))
@click.option("--port", type=click.IntRange(min=0), default=8000, show_default=True, **_env("HTTP_PORT"))
@click.option("--metrics-port", type=click.IntRange(min=0), default=9090, show_default=True,
              **_env("METRICS_PORT"))
@click.option("--policy", type=click.Choice(["load", "round-robin"]), default="load", show_default=True,
              help="load: the group that can start the request soonest; round-robin: each group in turn.",
              **_env("ROUTER_POLICY"))
@click.option("--prefix-affinity/--no-prefix-affinity", default=False,
              help="Keep requests with the same first prompt characters on one group while it has headroom.",
              **_env("ROUTER_PREFIX_AFFINITY"))
@click.option("--retry-seconds", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="How long a request no group has taken yet is retried on other groups.",
              **_env("ROUTER_RETRY_SECONDS"))
@click.option("--drain-seconds", type=click.FloatRange(min=0), default=25.0, show_default=True,
              help="On SIGTERM, how long accepted requests may finish before they are ended explicitly.",
              **_env("ROUTER_DRAIN_SECONDS"))
def router(deployment: str, host: str, port: int, metrics_port: int, policy: str, prefix_affinity: bool,
           retry_seconds: float, drain_seconds: float) -> None:
    """The deployment's OpenAI endpoint: each request to one DPA group's leader, chosen from the groups' state.

    The operator pushes the route table with the agent token (SHARDWISE_AGENT_TOKEN or the file
    SHARDWISE_AGENT_TOKEN_FILE names); with an API key (SHARDWISE_API_KEY, or the file SHARDWISE_API_KEY_FILE
    names) every API request must carry `Authorization: Bearer <key>`.
    """
    from shardwise.agents.auth import AgentTokenError, load_api_key, load_token
    from shardwise.agents.router import Options, run

    try:
        token, api_key = load_token(), load_api_key()
    except AgentTokenError as e:
        raise UsageFailure(str(e)) from e
    opts = Options(deployment=deployment, token=token, api_key=api_key,
                   policy=policy, prefix_affinity=prefix_affinity, retry_s=retry_seconds, drain_s=drain_seconds)
    sys.exit(run(opts, host, port, metrics_port))


@cli.command()
@click.option("--agent", "address", required=True, help="host:port of the agent's gRPC API.")
@click.option("--token", default=None, help="Agent token (default: $SHARDWISE_AGENT_TOKEN).")
@click.option("--tls-dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="A folder with the deployment's ca.crt, client.crt and client.key (keys of the Secret "
                   "NAME-agent-token): mutual TLS, which the operator's pods require.")
@click.option("--generation", type=click.IntRange(min=1), default=None, help="Default: the active one.")
@click.option("--deadline-ms", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--groups", default="", help="DPA groups for drain/abort, e.g. 2,3 (default: all it leads).")
@click.option("--ids", default="", help="abort: request ids, comma separated.")
@click.option("--map", "map_file", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help='migrate: JSON {"mapGeneration": N, "layers": {"0": [phy2log...], ...}}.')
@click.argument("command", type=click.Choice(["describe", "health", "stats", "pause", "resume", "drain", "abort",
                                              "migrate", "load"]))
def agentctl(address: str, token: str | None, tls_dir: Path | None, generation: int | None, deadline_ms: int,
             groups: str, ids: str, map_file: Path | None, command: str) -> None:
    """Call an agent's gRPC API and print the answer as JSON."""
    from shardwise.agents.ctl import call

    try:
        click.echo(json.dumps(call(address, token, command, generation=generation, deadline_ms=deadline_ms,
                                   groups=groups, ids=ids, map_file=map_file, tls_dir=tls_dir), indent=2))
    except ValueError as e:
        raise UsageFailure(str(e)) from e


@cli.group()
def dev() -> None:
    """The local cluster: API server emulator, process-backed nodes, scheduler, Prometheus."""


def _absolute(_ctx: click.Context, _param: click.Parameter, value: Path) -> Path:
    """The state directory as an absolute path, once, here: the cluster's pods run in folders of their own, and
    every path given to them (their volumes, SHARDWISE_AGENT_TOKEN_FILE) derives from it."""
    return Path(os.path.abspath(value))


_STATE_DIR = click.option("--state-dir", type=click.Path(path_type=Path, file_okay=False),
                          default=Path(".shardwise/dev"), show_default=True, callback=_absolute)


@dev.command("up")
@click.option("--nodes", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--prometheus", is_flag=True, help="Also run a real Prometheus scraping every pod's metrics port.")
@click.option("--persist", is_flag=True,
              help="Keep the API's objects (not Pods, Nodes, Events) in STATE_DIR/objects.json across down and up; "
                   "without it the cluster starts empty and the file is removed.")
@_STATE_DIR
def dev_up(nodes: int, gpus_per_node: int, prometheus: bool, persist: bool, state_dir: Path) -> None:
    """Start the local cluster in the background and write STATE_DIR/kubeconfig."""
    from shardwise.devcluster import dev as d

    try:
        d.check_state_dir(state_dir)
    except OSError as e:
        raise SpecInvalid([f"--state-dir {state_dir} cannot be written: {e.strerror or e}"]) from e
    try:
        st = d.up(state_dir, nodes=nodes, gpus_per_node=gpus_per_node, prometheus=prometheus, persist=persist)
    except RuntimeError as e:
        raise UsageFailure(str(e)) from e
    if st.persist != persist:
        click.echo(f"already running {'with' if st.persist else 'without'} --persist: `shardwise dev down` first "
                   "to change it", err=True)
    click.echo(f"API server  {st.api}\nkubeconfig  {st.kubeconfig}\nnodes       {st.nodes} x {st.gpus_per_node} "
               f"nvidia.com/gpu" + (f"\nprometheus  {st.prometheus}" if st.prometheus else "")
               + (f"\nobjects     kept in {state_dir / d.OBJECTS} at dev down" if st.persist else "")
               + f"\ntry: kubectl --kubeconfig {st.kubeconfig} get nodes")


@dev.command("down")
@_STATE_DIR
def dev_down(state_dir: Path) -> None:
    """Stop the local cluster and everything it started."""
    from shardwise.devcluster import dev as d

    click.echo("stopped" if d.down(state_dir) else "not running")


@dev.command("status")
@_STATE_DIR
def dev_status(state_dir: Path) -> None:
    """Whether the local cluster runs, its addresses, Ready nodes and pod count (JSON)."""
    from shardwise.devcluster import dev as d

    click.echo(json.dumps(d.status(state_dir), indent=2))


@dev.command("logs")
@click.argument("pod")
@click.option("--namespace", "-n", default="default", show_default=True)
@click.option("--container", "-c", default=None)
@click.option("--previous", "-p", is_flag=True, help="The run before the current one.")
@_STATE_DIR
def dev_logs(pod: str, namespace: str, container: str | None, previous: bool, state_dir: Path) -> None:
    """Print what a pod's container wrote (stdout and stderr)."""
    from shardwise.devcluster.kubelet import pod_log

    try:
        click.echo(pod_log(state_dir, namespace, pod, container, previous=previous), nl=False)
    except (FileNotFoundError, ValueError) as e:
        raise UsageFailure(str(e)) from e


@dev.command("nodes")
@click.option("--kubeconfig", type=click.Path(path_type=Path, exists=True, dir_okay=False), required=True)
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=4, show_default=True)
@_STATE_DIR
def dev_nodes(kubeconfig: Path, nodes: int, gpus_per_node: int, state_dir: Path) -> None:
    """Attach process-backed nodes and a scheduler to any cluster, until Ctrl-C or SIGTERM."""
    import signal
    import threading

    from shardwise.devcluster.aiokube import load_kubeconfig
    from shardwise.devcluster.cluster import Cluster

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with Cluster(load_kubeconfig(kubeconfig), state_dir=state_dir, nodes=nodes, gpus_per_node=gpus_per_node):
        click.echo(f"{nodes} node(s) with {gpus_per_node} nvidia.com/gpu each are Ready")
        stop.wait()


@dev.command("install-chart")
@click.option("--namespace", "-n", default="shardwise-system", show_default=True,
              help="The release namespace, created when absent (helm install --create-namespace).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="A chart value in helm's --set syntax (repeatable); wins over the local cluster's values.")
@click.option("--release", default="shardwise", show_default=True, help="The release name.")
@click.option("--chart", type=click.Path(path_type=Path, file_okay=False, exists=True), default=None,
              help="The chart directory (default: this project's charts/shardwise).")
@click.option("--kubeconfig", type=click.Path(path_type=Path, exists=True, dir_okay=False), default=None,
              help="The cluster's kubeconfig (default: STATE_DIR/kubeconfig, the cluster `shardwise dev up` runs).")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Wait for the operator's rollout (its pod Ready).")
@click.option("--timeout", type=click.IntRange(min=1), default=180, show_default=True,
              help="Seconds --wait waits.")
@_STATE_DIR
def dev_install_chart(namespace: str, sets: tuple[str, ...], release: str, chart: Path | None,
                      kubeconfig: Path | None, wait: bool, timeout: int, state_dir: Path) -> None:
    """Install the Helm chart's operator on the local cluster, as `helm install` would, so that it runs in-cluster.

    The chart is rendered by Helm's engine with values suited to the local cluster (the admission webhook off: the
    local API server calls none; NetworkPolicies on; free ports for the operator's health, metrics and webhook
    servers), then its CRD (when absent), the namespace and every object are applied with kubectl. The operator
    then runs as the chart's Deployment: a pod with the chart's ServiceAccount, its token mounted by the node, and
    only what the chart's RBAC grants. Running it again upgrades the objects."""
    from shardwise.devcluster import chart as c

    config = kubeconfig or state_dir / "kubeconfig"
    if not config.is_file():
        raise UsageFailure(f"no kubeconfig at {config}: start the local cluster with `shardwise dev up` (or name "
                           "one with --kubeconfig)")
    kubectl = c.kubectl_runner(config, timeout=max(60, timeout + 10))
    try:
        installed = c.install(kubectl, chart=chart or c.CHART, release=release, namespace=namespace, sets=sets)
        for name in installed.crds:
            click.echo(f"customresourcedefinition/{name} created")
        click.echo("\n".join(installed.objects))
        if wait:
            kubectl("rollout", "status", f"deployment/{installed.deployment}", "-n", namespace,
                    f"--timeout={timeout}s")
    except c.ChartError as e:
        raise UsageFailure(str(e)) from e
    click.echo(f"the operator {'runs' if wait else 'starts'} as deployment/{installed.deployment} in {namespace}; "
               f"its log: shardwise dev logs -n {namespace} POD (kubectl get pods -n {namespace})")


@dev.command("serve", hidden=True)
@click.option("--nodes", type=click.IntRange(min=1), default=2)
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=4)
@click.option("--prometheus", is_flag=True)
@click.option("--persist", is_flag=True)
@_STATE_DIR
def dev_serve(nodes: int, gpus_per_node: int, prometheus: bool, persist: bool, state_dir: Path) -> None:
    """The background process behind `dev up`."""
    from shardwise.devcluster import dev as d

    sys.exit(d.serve(state_dir, nodes=nodes, gpus_per_node=gpus_per_node, prometheus=prometheus, persist=persist))


@cli.command()
@click.option("--kubeconfig", default=None, help="Kubeconfig (default: $KUBECONFIG, ~/.kube/config or in-cluster).")
@click.option("--namespace", "-n", "namespaces", multiple=True, help="Watch only these namespaces (repeatable).")
@click.option("--all-namespaces", is_flag=True, help="Watch every namespace (the default without --namespace).")
@click.option("--agent-image", default="",
              help="Image of worker pods whose spec.runtime.image is empty, and of the routers.", **_env("AGENT_IMAGE"))
@click.option("--gang-scheduler", type=click.Choice(["", "volcano", "scheduler-plugins"]), default="",
              help="Add the pod-group annotation (volcano) or label (scheduler-plugins) to each world's pods.",
              **_env("GANG_SCHEDULER"))
@click.option("--gang-timeout", type=click.FloatRange(min=1), default=300.0, show_default=True,
              help="Seconds for every pod of a world to run before it is deleted and retried with backoff.",
              **_env("GANG_TIMEOUT"))
@click.option("--endpoint-picker", default="", help="NAME:PORT of the Gateway API endpoint picker each deployment's "
              "InferencePool names (default NAME-epp:9002); pools are made only where their CRD is installed.",
              **_env("ENDPOINT_PICKER"))
@click.option("--network-policy-namespace", default="", help="The operator's namespace: each deployment gets a "
              "NetworkPolicy that admits to its workers only its own pods, its router, the operator's pods there and "
              "namespaces labelled shardwise.io/gateway=true (empty: none).", **_env("NETWORK_POLICY_NAMESPACE"))
@click.option("--prometheus-allow", "prometheus_allow", multiple=True, help="A Prometheus URL that "
              "spec.autoscaling.prometheusUrl may name (repeatable; same scheme, host and port, a path below); none: "
              "any http(s) URL.", **_env("PROMETHEUS_ALLOW"))
@click.option("--health-port", type=click.IntRange(min=0), default=0, help="Liveness endpoint /healthz (0: none).")
@click.option("--metrics-port", type=click.IntRange(min=0), default=0, help="Prometheus /metrics (0: none).")
@click.option("--webhook-port", type=click.IntRange(min=0), default=0, help="Admission webhook HTTPS port (0: none).")
@click.option("--webhook-cert", default=None, help="PEM certificate of the webhook server.")
@click.option("--webhook-key", default=None, help="PEM private key of the webhook server.")
@click.option("--webhook-insecure", is_flag=True, help="Serve the webhook over plain HTTP (local testing only).")
@click.option("--leader-election-name", default="", help="Lease name; empty: no leader election (one replica).")
@click.option("--leader-election-namespace", default="", help="Namespace of the Lease.")
def operator(kubeconfig: str | None, namespaces: tuple[str, ...], all_namespaces: bool, agent_image: str,
             gang_scheduler: str, gang_timeout: float, endpoint_picker: str,
             network_policy_namespace: str, prometheus_allow: tuple[str, ...], health_port: int,
             metrics_port: int,
             webhook_port: int,
             webhook_cert: str | None, webhook_key: str | None, webhook_insecure: bool, leader_election_name: str,
             leader_election_namespace: str) -> None:
    """Run the operator: InferenceDeployments become worker pods, services and status (kopf)."""
    if all_namespaces and namespaces:
        raise UsageFailure("--all-namespaces and --namespace exclude each other")
    from shardwise.operator.builders import BuildOptions
    from shardwise.operator.handlers import Settings
    from shardwise.operator.main import OperatorOptions, run
    from shardwise.operator.reconcile import ReconcileOptions

    settings = Settings(kubeconfig=kubeconfig, options=ReconcileOptions(
        build=BuildOptions(image=agent_image, gang_scheduler=gang_scheduler, endpoint_picker=endpoint_picker,
                           network_policy_namespace=network_policy_namespace),
        gang_timeout_s=gang_timeout, prometheus_allow=prometheus_allow),
        webhook_port=webhook_port, webhook_cert=webhook_cert, webhook_key=webhook_key,
        webhook_insecure=webhook_insecure)
    code = run(OperatorOptions(settings=settings, namespaces=namespaces, health_port=health_port,
                               metrics_port=metrics_port, leader_name=leader_election_name,
                               leader_namespace=leader_election_namespace))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # kopf's worker threads may still wait on the API: they must not hold the exit


@cli.command()
def crd() -> None:
    """Print the InferenceDeployment CRD generated from the API types."""
    from shardwise.crd import render

    click.echo(render(), nl=False)


@cli.command()
@click.option("--examples", type=click.Path(path_type=Path, file_okay=False), default=Path("examples"),
              show_default=True)
def demo(examples: Path) -> None:
    """The main job of `make demo`: plan every example deployment, search one model's layouts, then run the
    operator on a local cluster, apply tiny-moe and compare its completions with the oracle."""
    from shardwise.demo import main as run_demo

    if run_demo(examples):
        raise SpecInvalid(["an example deployment is invalid (see above)"])
    from shardwise.devcluster.cluster_demo import run as cluster_demo

    click.echo("\n== the operator on a local cluster ==")
    if not cluster_demo(examples / "tiny-moe.yaml", click.echo):
        raise UsageFailure("a served completion differed from the oracle")


@cli.command()
def presets() -> None:
    """List the model and GPU presets."""
    from shardwise import render

    render.presets_table()


def _fail(code: int, lines: list[str]) -> NoReturn:
    for line in lines:
        click.echo(f"error: {line}", err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="shardwise", standalone_mode=False)
    except SpecInvalid as e:
        _fail(EXIT_INVALID, e.lines)
    except UsageFailure as e:
        _fail(EXIT_USAGE, [str(e)])
    except click.UsageError as e:
        if type(e).__name__.startswith("NoArgsIsHelp") and e.ctx is not None:
            click.echo(e.ctx.get_help())
            sys.exit(0)
        _fail(EXIT_USAGE, [e.format_message()])
    except click.ClickException as e:
        _fail(EXIT_USAGE, [e.format_message()])
    except click.exceptions.Abort:
        _fail(EXIT_USAGE, ["aborted"])
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main()
