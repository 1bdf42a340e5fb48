"""vLLM as an engine: the command line of each worker pod's vLLM server, derived from the plan, and the layouts
vLLM cannot run, refused at admission with vLLM's rule named. Pure functions of the spec and the plan.

How a shardwise layout maps onto vLLM's (vLLM 0.32):

    shardwise                      vLLM
    tp x cp, cpMode dcp            --tensor-parallel-size tp*cp --decode-context-parallel-size cp
                                   (decode CP shards the KV cache over the TP group, it adds no GPU)
    tp, cp, cpMode pcp             --tensor-parallel-size tp --prefill-context-parallel-size cp
    pp                             --pipeline-parallel-size pp
    dpa                            --data-parallel-size dpa; one data-parallel rank = tp*cp*pp GPUs
    ep (MoE, > 1)                  --enable-expert-parallel (vLLM's EP group is every rank: dpa*tp*cp)
    eplb                           --enable-eplb --eplb-config {window_size, step_interval,
                                   num_redundant_experts}
    serving.*                      --max-model-len, --max-num-batched-tokens, --gpu-memory-utilization,
                                   --max-num-seqs (maxRunning, when set)

Across pods (one pod per node slice of `gpusPerNode` GPUs):

- a data-parallel rank fits in a pod: pod i runs its `L = GPUs / (tp*cp*pp)` ranks with
  `--data-parallel-size-local L --data-parallel-start-rank i*L`, meets pod 0 at `--data-parallel-address` /
  `--data-parallel-rpc-port`, and with `--data-parallel-hybrid-lb` its own API server serves its own ranks
  (L = 1: `--data-parallel-rank`, vLLM's external load balancing, for MoE models only);
- a data-parallel rank spans pods (only with dpa = 1): `--nnodes N --node-rank i --master-addr pod-0
  --master-port`, and every pod but pod 0 runs `--headless` (it serves no API).

The API key is never on the command line: the pods read it from the deployment's Secret into `VLLM_API_KEY`,
which vLLM takes as `--api-key`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

from .api import CpMode, DType, Engine, InferenceDeploymentSpec
from .planner import Plan

#: the port vLLM's API server listens on inside a pod (the agent serves the pod's port 8000 in front of it)
API_PORT = 8001
#: data-parallel coordination of pod 0 (ZMQ), when data-parallel ranks run on several pods
RPC_PORT = 13345
#: torch.distributed meeting of a multi-pod data-parallel rank (`--master-port`)
MASTER_PORT = 29600
#: vLLM's own server module: the `vllm` console script looks for a distribution named `vllm`, absent from
#: vLLM's CPU build, so pods run the module
ENTRYPOINT = ("-m", "vllm.entrypoints.openai.api_server")

#: flags derived from the spec: extra arguments may not set them
DERIVED = frozenset({
    "--model", "--served-model-name", "--host", "--port", "--tensor-parallel-size", "-tp",
    "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp", "--data-parallel-size-local",
    "--data-parallel-start-rank", "--data-parallel-rank", "--data-parallel-address", "--data-parallel-rpc-port",
    "--data-parallel-hybrid-lb", "--headless", "--nnodes", "--node-rank", "--master-addr", "--master-port",
    "--enable-expert-parallel", "--enable-eplb", "--eplb-config", "--decode-context-parallel-size",
    "--prefill-context-parallel-size", "--max-model-len", "--max-num-batched-tokens", "--gpu-memory-utilization",
    "--dtype", "--api-key", "--shutdown-timeout", "--max-num-seqs",
})
#: where a flag in extraArgs comes from instead
CPU_MOE_ALIGN = 32  # vLLM's CPU grouped-GEMM MoE kernels: the hidden size a multiple of this
CPU_MLA_DIMS = (512, 64)  # vLLM's CPU MLA decode kernel: kv_lora_rank and qk_rope_head_dim (a 576-value latent)
SIGMOID_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}  # DeepSeek-V3's routing, in vLLM's terms

_SOURCE = {"--model": "spec.model.source", "--served-model-name": "spec.model.servedName",
           "--api-key": "spec.runtime.apiKeySecret", "--dtype": "spec.model.dtype",
           "--max-model-len": "spec.serving.maxModelLen", "--max-num-batched-tokens": "spec.serving.maxBatchTokens",
           "--gpu-memory-utilization": "spec.serving.memoryFraction", "--max-num-seqs": "spec.serving.maxRunning",
           "--enable-eplb": "spec.eplb",
           "--eplb-config": "spec.eplb", "--shutdown-timeout": "spec.elastic.scaleDown.drainTimeoutSeconds"}


@dataclass(frozen=True)
class PodCommand:
    """What one worker pod runs: vLLM's arguments (after `python -m vllm.entrypoints.openai.api_server`) and
    the environment variables shardwise sets for it (the user's `spec.runtime.env` comes on top)."""

    args: tuple[str, ...]
    env: Mapping[str, str]
    serves_api: bool  # False for a --headless pod


def vllm_sizes(spec: InferenceDeploymentSpec) -> tuple[int, int, int]:
    """(tensor-parallel size, pipeline size, GPUs of one data-parallel rank) as vLLM counts them."""
    par = spec.parallelism
    tp = par.tp * par.cp if par.cp > 1 and par.cp_mode is CpMode.DCP else par.tp
    return tp, par.pp, par.tp * par.cp * par.pp


def refusals(spec: InferenceDeploymentSpec, plan: Plan) -> list[str]:
    """Why vLLM cannot run this layout (empty when it can), each message naming the field and vLLM's rule."""
    par, out = spec.parallelism, []
    arch = plan.arch
    moe = arch is not None and arch.is_moe
    if spec.model.source is None:
        out.append("spec.model.source: engine vllm serves a checkpoint: give model.source (presets and inline "
                   "architectures have no weights files)")
    if spec.model.dtype in (DType.FLOAT64, DType.FP8):
        out.append(f"spec.model.dtype: vLLM computes in bfloat16, float16 or float32, not {spec.model.dtype.value}"
                   + (" (fp8 weights come from a quantized checkpoint's own config)" if spec.model.dtype is DType.FP8
                      else ""))
    if par.moe_tp > 1:
        out.append(f"spec.parallelism.moeTp: vLLM splits experts by expert parallelism or by the TP group, not "
                   f"both; moeTp must be 1, got {par.moe_tp}")
    if moe and par.ep is not None and par.ep not in (1, par.stage_size):
        out.append(f"spec.parallelism.ep: vLLM's expert-parallel group is every rank of the world (dpa*cp*tp = "
                   f"{par.stage_size}) or none (ep 1), got ep={par.ep}")
    if spec.eplb.enabled and not (moe and par.ep_size > 1):
        out.append("spec.eplb.enabled: vLLM's EPLB needs expert parallelism (--enable-expert-parallel), which "
                   f"needs a MoE model with ep > 1 (ep={par.ep_size}"
                   + (", dense model)" if not moe else ")"))
    if spec.eplb.redundant_experts and not spec.eplb.enabled:
        out.append("spec.eplb.redundantExperts: vLLM allocates redundant experts only with EPLB "
                   "(num_redundant_experts needs --enable-eplb): set eplb.enabled")
    if par.cp > 1 and par.cp_mode is CpMode.PCP and par.dpa > 1:
        out.append(f"spec.parallelism.cp: vLLM runs prefill context parallelism without data parallelism; "
                   f"cp={par.cp} with cpMode pcp needs dpa 1, got {par.dpa}")
    if par.cp > 1 and par.cp_mode is CpMode.DCP and arch is not None and arch.attention_type.value != "mla":
        tp_v, kv, q = par.tp * par.cp, arch.kv_heads, arch.num_heads
        if tp_v <= kv or par.cp > tp_v // kv or (q // kv) % par.cp:
            out.append(f"spec.parallelism.cp: vLLM's decode CP of a GQA model splits the KV heads' copies: it "
                       f"needs tp*cp ({tp_v}) > KV heads ({kv}), cp ({par.cp}) <= tp*cp // KV heads, and the "
                       f"query heads per KV head ({q // kv}) divisible by cp")
    if spec.eplb.enabled and spec.hardware.gpu == "cpu":
        out.append("spec.eplb.enabled: vLLM's EPLB runs on CUDA, ROCm or XPU, not on its CPU build")
    if spec.hardware.gpu == "cpu" and moe and (par.dpa > 1 or par.ep_size > 1):
        out.append(f"spec.parallelism: vLLM's CPU build cannot run a MoE model with data or expert parallelism "
                   f"(dpa={par.dpa}, ep={par.ep_size}): its CPU communicator has no all_gatherv, so the first "
                   "step fails; use dpa 1 and ep 1 (experts split over the TP group)")
    if spec.hardware.gpu == "cpu" and moe and arch is not None and arch.hidden_size % CPU_MOE_ALIGN:
        out.append(f"spec.model: vLLM's CPU MoE kernels need a hidden size divisible by {CPU_MOE_ALIGN}; the "
                   f"checkpoint's is {arch.hidden_size} (\"No Unquantized MoE backend supports the deployment "
                   "configuration\")")
    if (spec.hardware.gpu == "cpu" and arch is not None and arch.attention_type.value == "mla"
            and (arch.kv_lora_rank, arch.rope_head_dim) != CPU_MLA_DIMS):
        out.append(f"spec.model: vLLM's CPU MLA decode kernel computes only a latent of kv_lora_rank "
                   f"{CPU_MLA_DIMS[0]} + qk_rope_head_dim {CPU_MLA_DIMS[1]} (DeepSeek-V3's); the checkpoint's is "
                   f"{arch.kv_lora_rank} + {arch.rope_head_dim}: serve it with engine reference")
    _, _, per_dp = vllm_sizes(spec)
    gpus = plan.gpus_per_pod or spec.hardware.gpus_per_node
    pods = plan.pod_count or 1
    if pods > 1 and per_dp <= gpus and gpus % per_dp:
        out.append(f"spec.hardware.gpusPerNode: a vLLM data-parallel rank (tp*cp*pp = {per_dp} GPUs) must divide "
                   f"a pod's {gpus} GPUs")
    if pods > 1 and per_dp > gpus:
        if par.dpa > 1:
            out.append(f"spec.parallelism.dpa: a vLLM data-parallel rank of {per_dp} GPUs spans pods of {gpus}; "
                       f"vLLM runs such a rank across nodes (--nnodes) with dpa 1 only, got dpa={par.dpa}")
        elif per_dp % gpus:
            out.append(f"spec.hardware.gpusPerNode: vLLM's --nnodes must divide the world of {per_dp} GPUs into "
                       f"equal nodes; {gpus} GPUs per pod do not")
    if pods > 1 and per_dp == gpus and par.dpa > 1 and not moe:
        out.append("spec.parallelism.dpa: with one vLLM data-parallel rank per pod vLLM balances load externally, "
                   "which it allows for MoE models only (\"Non-MoE models do not support external data parallel "
                   "mode\"): put several data-parallel ranks on a pod or run a MoE model")
    for i, arg in enumerate(spec.runtime.args):
        flag = arg.split("=", 1)[0]
        if flag in DERIVED:
            out.append(f"spec.runtime.args[{i}]: {flag} is derived from "
                       f"{_SOURCE.get(flag, 'spec.parallelism')}; remove it from args")
    return out


def eplb_config(spec: InferenceDeploymentSpec) -> str:
    """`--eplb-config` from `spec.eplb`: the load window and the rebalance interval in engine steps."""
    e = spec.eplb
    return json.dumps({"window_size": e.window_steps, "step_interval": e.window_steps,
                       "num_redundant_experts": e.redundant_experts}, separators=(",", ":"))


def cpu_kv_cache_gib(plan: Plan) -> int:
    """vLLM's CPU build: the KV cache each rank allocates in host memory, in GiB (the plan's KV budget of one
    rank, at least 1)."""
    kv = plan.stage_ledger[0].kv_cache_bytes if plan.stage_ledger else 0
    return max(1, math.ceil(kv / 2**30))


def _cpu_env(spec: InferenceDeploymentSpec, plan: Plan, local_gpus: int) -> dict[str, str]:
    """vLLM's CPU build: its KV cache in GiB (`cpu_kv_cache_gib`), and one core per rank of the pod (without a
    binding it refuses to start TP on a one-NUMA-node machine)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cpu_kv_cache_gib(plan))}
    if local_gpus > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(c) for c in range(local_gpus))
    return env


def pod_command(spec: InferenceDeploymentSpec, plan: Plan, index: int, *, served_name: str, leader: str,
                host: str = "$(SHARDWISE_POD_IP)") -> PodCommand:
    """Pod `index`'s vLLM command line. `leader` is pod 0's address (its stable DNS name); `host` is what vLLM
    binds to (the pod IP, expanded by the kubelet)."""
    par, serving = spec.parallelism, spec.serving
    tp, pp, per_dp = vllm_sizes(spec)
    pods = plan.pods()
    gpus = len(pods[index]) if pods else per_dp
    assert spec.model.source is not None, "refusals() first"
    args = ["--model", spec.model.source.mount_path, "--served-model-name", served_name,
            "--host", host, "--port", str(API_PORT),
            "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
    if par.cp > 1:
        flag = "--decode-context-parallel-size" if par.cp_mode is CpMode.DCP else "--prefill-context-parallel-size"
        args += [flag, str(par.cp)]
    serves = True
    if len(pods) > 1 and per_dp > plan.gpus_per_pod:  # one data-parallel rank across pods
        args += ["--nnodes", str(len(pods)), "--node-rank", str(index), "--master-addr", leader,
                 "--master-port", str(MASTER_PORT)]
        if index > 0:
            args.append("--headless")
            serves = False
    elif par.dpa > 1:
        args += ["--data-parallel-size", str(par.dpa)]
        if len(pods) > 1:
            local = gpus // per_dp
            start = sum(len(p) for p in pods[:index]) // per_dp
            if local > 1:
                args += ["--data-parallel-size-local", str(local), "--data-parallel-start-rank", str(start)]
            else:
                args += ["--data-parallel-rank", str(start)]
            args += ["--data-parallel-address", leader, "--data-parallel-rpc-port", str(RPC_PORT)]
            if local > 1:
                args.append("--data-parallel-hybrid-lb")
    if plan.arch is not None and plan.arch.is_moe and par.ep_size > 1:
        args.append("--enable-expert-parallel")
        if spec.eplb.enabled:
            args += ["--enable-eplb", "--eplb-config", eplb_config(spec)]
    args += ["--max-model-len", str(plan.max_model_len), "--max-num-batched-tokens",
             str(serving.max_batch_tokens), "--gpu-memory-utilization", f"{serving.memory_fraction:g}",
             "--dtype", spec.model.dtype.value,
             # on SIGTERM vLLM finishes in-flight requests for this long before it aborts the rest
             "--shutdown-timeout", str(spec.elastic.scale_down.drain_timeout_seconds)]
    if serving.max_running is not None:
        args += ["--max-num-seqs", str(serving.max_running)]
    if spec.model.kv_cache_dtype is DType.FP8:
        args += ["--kv-cache-dtype", "fp8"]
    env: dict[str, str] = {}
    if spec.hardware.gpu == "cpu":
        args.append("--enforce-eager")  # no torch.compile: vLLM's CPU build starts in under a minute
        env.update(_cpu_env(spec, plan, gpus))
    if (plan.arch is not None and plan.arch.router_scoring == "sigmoid"
            and not any(a.split("=", 1)[0] == "--hf-overrides" for a in spec.runtime.args)):
        # vLLM takes DeepSeek-V3's routing from topk_method and scoring_func, which DeepSeek's own config.json
        # carries and transformers' save_pretrained leaves out (transformers always routes this way): said outright
        args += ["--hf-overrides", json.dumps(SIGMOID_ROUTING, separators=(",", ":"))]
    args += list(spec.runtime.args)
    return PodCommand(tuple(args), env, serves)


#: what each engine does for each operation (status.engine.operations, and the README's table)
OPERATIONS: dict[Engine, dict[str, str]] = {
    Engine.REFERENCE: {
        "scale": "in place: two-phase scale-up, drain-or-abort scale-down, no restart",
        "recover": "in place: the surviving groups re-form a world, the lost pod is replaced",
        "eplb": "control plane: measured load, placement computed by the operator, experts migrated live",
        "drain": "per DPA group",
    },
    Engine.VLLM: {
        "scale": "re-form: the pods drain (stop admitting, finish in-flight requests) and restart at the new size",
        "recover": "re-form: a lost pod restarts the world; a crashed vLLM restarts in its pod with backoff",
        "eplb": "vLLM's own (--enable-eplb, configured from spec.eplb)",
        "drain": "per pod",
    },
}


def capabilities(engine: Engine) -> dict[str, object]:
    return {"name": engine.value, "operations": dict(OPERATIONS[engine])}
