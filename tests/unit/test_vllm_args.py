"""engine vllm: each worker pod's vLLM command line is derived from the plan (never hand-written), held here
as exact argument lists for representative layouts, checked by vLLM's own parser where vLLM is installed, and
the layouts vLLM cannot run are refused with its rule named."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from shardwise import presets, vllm
from shardwise.api import InferenceDeploymentSpec
from shardwise.planner import plan
from tests.vllm_env import PARSE, SKIP_REASON, vllm_python

LEADER = "big-0.big-workers.prod.svc"


def spec(preset: str, parallelism: dict[str, Any], **sections: Any) -> InferenceDeploymentSpec:
    arch = presets.model_preset(preset).model_dump(mode="json", by_alias=True)
    body: dict[str, Any] = {
        "model": {"source": {"pvc": {"claimName": "models", "subPath": preset}}, "architecture": arch,
                  "servedName": preset},
        "hardware": {"gpu": "H200", "gpusPerNode": 8}, "parallelism": parallelism,
        "elastic": {"maxDpa": 64}, "runtime": {"engine": "vllm"}}
    for key, value in sections.items():
        body[key] = {**body.get(key, {}), **value}
    return InferenceDeploymentSpec.model_validate(body)


def commands(s: InferenceDeploymentSpec) -> list[vllm.PodCommand]:
    p = plan(s)
    assert not p.errors and not vllm.refusals(s, p), (p.errors, vllm.refusals(s, p))
    return [vllm.pod_command(s, p, i, served_name=s.model.served_name or "", leader=LEADER)
            for i in range(p.pod_count)]


def common(preset: str, tp: int, pp: int) -> list[str]:
    return ["--model", f"/models/models/{preset}", "--served-model-name", preset, "--host", "$(SHARDWISE_POD_IP)",
            "--port", "8001", "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]


def serving(preset: str) -> list[str]:
    """The serving flags of a spec that leaves maxModelLen out: vLLM gets the model's positions (40960 for
    Qwen3-235B-A22B, 163840 for DeepSeek-V3, 131072 for Llama-3.1-405B), not a length it would refuse."""
    positions = {"Qwen3-235B-A22B": 40960, "DeepSeek-V3": 163840, "Llama-3.1-405B": 131072}[preset]
    return ["--max-model-len", str(positions), "--max-num-batched-tokens", "8192", "--gpu-memory-utilization",
            "0.9", "--dtype", "bfloat16", "--shutdown-timeout", "120"]


def dp_pod(dpa: int, local: int, start: int) -> list[str]:
    return ["--data-parallel-size", str(dpa), "--data-parallel-size-local", str(local),
            "--data-parallel-start-rank", str(start), "--data-parallel-address", LEADER,
            "--data-parallel-rpc-port", "13345", "--data-parallel-hybrid-lb"]


EPLB = ["--enable-expert-parallel", "--enable-eplb", "--eplb-config",
        '{"window_size":1000,"step_interval":1000,"num_redundant_experts":32}']

LAYOUTS = {
    # DeepSeek-V3, wide EP over 4 x 8 H200: 32 data-parallel ranks, 8 per pod, each pod's API serves its own
    "deepseek-v3-wide-ep": (
        spec("DeepSeek-V3", {"tp": 1, "dpa": 32}, eplb={"enabled": True, "redundantExperts": 32}),
        [common("DeepSeek-V3", 1, 1) + dp_pod(32, 8, 8 * i) + EPLB + serving("DeepSeek-V3") for i in range(4)]),
    # Qwen3-235B-A22B, TP 4 x DPA 4 on 2 x 8: two data-parallel ranks per pod
    "qwen3-235b-tp4-dpa4": (
        spec("Qwen3-235B-A22B", {"tp": 4, "dpa": 4}),
        [common("Qwen3-235B-A22B", 4, 1) + dp_pod(4, 2, 2 * i) + ["--enable-expert-parallel"]
         + serving("Qwen3-235B-A22B")
         for i in range(2)]),
    # Llama-3.1-405B, TP 8 x PP 2: one data-parallel rank over two pods; pod 1 serves no API
    "llama-405b-tp8-pp2": (
        spec("Llama-3.1-405B", {"tp": 8, "pp": 2}),
        [common("Llama-3.1-405B", 8, 2) + ["--nnodes", "2", "--node-rank", str(i), "--master-addr", LEADER,
                                           "--master-port", "29600"] + (["--headless"] if i else [])
         + serving("Llama-3.1-405B")
         for i in range(2)]),
    # decode CP: the KV cache of an MLA model sharded over the TP group (cp adds no GPU in vLLM); one
    # data-parallel rank per pod, so vLLM balances externally: each pod names its rank
    "deepseek-v3-tp2-dcp4-dpa2": (
        spec("DeepSeek-V3", {"tp": 2, "cp": 4, "dpa": 2}),
        [[*common("DeepSeek-V3", 8, 1), "--decode-context-parallel-size", "4", "--data-parallel-size", "2",
          "--data-parallel-rank", str(i), "--data-parallel-address", LEADER, "--data-parallel-rpc-port", "13345",
          "--enable-expert-parallel", *serving("DeepSeek-V3")] for i in range(2)]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_pod_runs_the_vllm_command_line_its_layout_implies(layout: str) -> None:
    s, want = LAYOUTS[layout]
    got = commands(s)
    assert [list(c.args) for c in got] == want
    assert [c.serves_api for c in got] == ["--headless" not in w for w in want]


@pytest.mark.skipif(vllm_python() is None, reason=SKIP_REASON)
def test_vllms_own_parser_reads_every_derived_command_line_as_the_plan_means_it() -> None:
    cases = [(layout, i, list(c.args)) for layout in LAYOUTS for i, c in enumerate(commands(LAYOUTS[layout][0]))]
    argv = [[a.replace("$(SHARDWISE_POD_IP)", "10.0.0.7") for a in args] for _, _, args in cases]
    python = vllm_python()
    assert python is not None
    out = subprocess.run([python, str(PARSE)], input=json.dumps(argv), capture_output=True, text=True, cwd="/",
                         timeout=300, check=True)
    parsed = json.loads(out.stdout.strip().splitlines()[-1])
    for (layout, i, _), got in zip(cases, parsed, strict=True):
        s = LAYOUTS[layout][0]
        assert "error" not in got, (layout, i, got)
        par = s.parallelism
        assert got["pipeline_parallel_size"] == par.pp
        assert got["tensor_parallel_size"] == vllm.vllm_sizes(s)[0]
        assert got["decode_context_parallel_size"] == (par.cp if par.cp_mode.value == "dcp" else 1)
        assert got["data_parallel_size"] == (par.dpa if par.dpa > 1 else 1)
        assert got["max_model_len"] == plan(s).max_model_len
        assert got["served_model_name"] == [s.model.served_name]
        assert got["shutdown_timeout"] == 120
        if s.eplb.enabled:
            assert got["enable_eplb"] and got["eplb_config"]["num_redundant_experts"] == 32
    dsv3 = [got for (layout, _, _), got in zip(cases, parsed, strict=True) if layout == "deepseek-v3-wide-ep"]
    assert [g["data_parallel_start_rank"] for g in dsv3] == [0, 8, 16, 24]
    assert all(g["data_parallel_hybrid_lb"] and g["data_parallel_size_local"] == 8 for g in dsv3)


REFUSED = {
    "no checkpoint": ({"model": {"preset": "tiny-moe", "dtype": "float32"}}, "spec.model.source"),
    "float64": ({"model": {"dtype": "float64"}}, "spec.model.dtype: vLLM computes in bfloat16, float16 or float32"),
    "moe tp": ({"parallelism": {"tp": 2, "dpa": 4, "ep": 4, "moeTp": 2}}, "spec.parallelism.moeTp"),
    "partial ep": ({"parallelism": {"tp": 1, "dpa": 8, "ep": 4}}, "every rank of the world (dpa*cp*tp = 8)"),
    "eplb on a dense model": ({"model": {"preset": None}, "eplb": {"enabled": True}, "dense": True},
                              "spec.eplb.enabled: vLLM's EPLB needs expert parallelism"),
    "pcp with dp": ({"parallelism": {"tp": 2, "dpa": 2, "cp": 2, "cpMode": "pcp"}},
                    "prefill context parallelism without data parallelism"),
    "a derived flag in args": ({"runtime": {"args": ["--tensor-parallel-size=4"]}},
                               "spec.runtime.args[0]: --tensor-parallel-size is derived from spec.parallelism"),
    "a rank across pods with dp": ({"parallelism": {"tp": 8, "pp": 2, "dpa": 2}},
                                   "--nnodes) with dpa 1 only, got dpa=2"),
    "dense dp with one rank per pod": ({"parallelism": {"tp": 8, "dpa": 2}, "dense": True},
                                       "Non-MoE models do not support external data parallel mode"),
    "moe dp on the cpu build": ({"hardware": {"gpu": "cpu", "gpusPerNode": 8}, "model": {"dtype": "float32"},
                                 "parallelism": {"tp": 1, "dpa": 2}},
                                "vLLM's CPU build cannot run a MoE model with data or expert parallelism (dpa=2"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_layouts_vllm_cannot_run_are_refused_with_its_rule(case: str) -> None:
    change, message = REFUSED[case]
    change = dict(change)
    dense = change.pop("dense", False)
    s = spec("Llama-3.1-405B" if dense else "Qwen3-235B-A22B", change.pop("parallelism", {"tp": 4, "dpa": 2}))
    body = s.model_dump(mode="json", by_alias=True, exclude_none=True)
    for key, value in change.items():
        body[key] = {k: v for k, v in {**body[key], **value}.items() if v is not None}
        if key == "model" and "preset" in value and value["preset"]:
            body[key].pop("source"), body[key].pop("architecture")
    s = InferenceDeploymentSpec.model_validate(body)
    found = vllm.refusals(s, plan(s))
    assert any(message in f for f in found), found


def test_cpu_pods_get_vllms_cpu_settings_from_the_plan() -> None:
    s = spec("Qwen3-30B-A3B", {"tp": 2, "ep": 1}, hardware={"gpu": "cpu", "gpusPerNode": 2},
             model={"dtype": "float32"},
             serving={"maxModelLen": 256, "maxBatchTokens": 256, "workspaceMib": 64})
    p = plan(s)
    assert not vllm.refusals(s, p)
    c = vllm.pod_command(s, p, 0, served_name="q", leader=LEADER)
    assert "--enforce-eager" in c.args and "--enable-expert-parallel" not in c.args
    assert c.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and int(c.env["VLLM_CPU_KVCACHE_SPACE"]) >= 1


def test_a_vllm_worker_pod_runs_the_agent_over_vllm_from_the_spec_image_with_its_key_and_env() -> None:
    from shardwise.operator import builders as b

    owner = {"apiVersion": "shardwise.io/v1alpha1", "kind": "InferenceDeployment",
             "metadata": {"name": "big", "namespace": "prod", "uid": "u-1"}}
    s = spec("Qwen3-235B-A22B", {"tp": 4, "dpa": 4},
             runtime={"image": "registry/shardwise-vllm:0.32.0", "args": ["--enable-prefix-caching"],
                      "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
                      "apiKeySecret": {"name": "big-api", "key": "key"}},
             elastic={"scaleDown": {"drainTimeoutSeconds": 90}})
    p = plan(s)
    pod = b.build_pod(owner, s, p, 1, 3, b.BuildOptions(image="operator-image:1"))
    c = pod["spec"]["containers"][0]
    assert c["image"] == "registry/shardwise-vllm:0.32.0"  # the operator's agent image has no vLLM
    assert c["command"] == ["shardwise", "agent", "--engine", "vllm", "--"]
    want = common("Qwen3-235B-A22B", 4, 1) + dp_pod(4, 2, 2) + ["--enable-expert-parallel"] + serving(
        "Qwen3-235B-A22B")
    want[want.index("--shutdown-timeout") + 1] = "90"
    assert c["args"] == [a.replace(LEADER, "big-0.big-workers.prod.svc") for a in want] + ["--enable-prefix-caching"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}
    assert env["VLLM_API_KEY"] == {"secretKeyRef": {"name": "big-api", "key": "key"}}
    assert env["NCCL_DEBUG"] == "WARN" and env["SHARDWISE_ENGINE"] == "vllm"
    assert {"name": "vllm-rpc", "containerPort": vllm.RPC_PORT} in c["ports"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 120  # the drain, then vLLM's own stop
    # vLLM's images run as root: no user forced, but no capabilities, no escalation, the runtime's seccomp
    assert pod["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "http"}
    bigger = spec("Qwen3-235B-A22B", {"tp": 4, "dpa": 6})
    assert b.template_hash(bigger) != b.template_hash(spec("Qwen3-235B-A22B", {"tp": 4, "dpa": 4})), \
        "vLLM forms its world once: a dpa change must roll its pods"


def test_the_autoscalers_default_query_reads_vllms_series_for_a_vllm_deployment() -> None:
    from shardwise.controllers.autoscaler import default_query

    q = default_query("web", "ml", engine="vllm")
    for series in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert f'{series}{{deployment="web",namespace=~"ml|"}}' in q
    assert "shardwise_" not in q
    with pytest.raises(ValueError, match="unknown engine 'sglang'"):
        default_query("web", "ml", engine="sglang")


def test_status_says_which_operations_each_engine_does_in_place() -> None:
    from shardwise.api import Engine

    assert vllm.capabilities(Engine.VLLM)["operations"]["scale"].startswith("re-form")
    assert vllm.capabilities(Engine.REFERENCE)["operations"]["scale"].startswith("in place")


def test_a_batch_limit_becomes_max_num_seqs_and_cannot_be_set_twice() -> None:
    s = spec("Qwen3-30B-A3B", {"tp": 8}, serving={"maxRunning": 32})
    (cmd,) = commands(s)
    args = list(cmd.args)
    assert args[args.index("--max-num-seqs") + 1] == "32"
    assert "--max-num-seqs" not in commands(spec("Qwen3-30B-A3B", {"tp": 8}))[0].args  # vLLM's default
    twice = spec("Qwen3-30B-A3B", {"tp": 8}, runtime={"args": ["--max-num-seqs", "8"]})
    assert any("spec.serving.maxRunning" in m for m in vllm.refusals(twice, plan(twice)))


def cpu_deepseek(args: tuple[str, ...] = (), **arch: Any) -> InferenceDeploymentSpec:
    """A small DeepSeek-V3-shaped checkpoint on vLLM's CPU build (tp 1), its architecture changed by `arch`."""
    base = spec("DeepSeek-V3", {"tp": 1, "ep": 1}, hardware={"gpu": "cpu", "gpusPerNode": 1},
                model={"dtype": "float32"}, serving={"maxModelLen": 256, "maxBatchTokens": 256, "workspaceMib": 64})
    body = base.model_dump(mode="json", by_alias=True, exclude_none=True)
    body["model"]["architecture"].update({"numLayers": 2, "hiddenSize": 64, "vocabSize": 331, "numHeads": 4,
                                          "intermediateSize": 64, "numExperts": 8, "topK": 2,
                                          "moeIntermediateSize": 32, "firstDenseLayers": 1, "numExpertGroups": 2,
                                          "topkGroups": 1, "qLoraRank": 32, "nopeHeadDim": 16, "vHeadDim": 16,
                                          "routerScoring": "sigmoid", **arch})
    body["runtime"]["args"] = list(args)
    return InferenceDeploymentSpec.model_validate(body)


def test_deepseek_v3_on_vllms_cpu_build_gets_its_routing_said_outright_and_needs_its_kernels_sizes() -> None:
    s = cpu_deepseek()  # kv_lora_rank 512 + rope 64, hidden 64: what vLLM's CPU kernels compute
    p = plan(s)
    assert not p.errors and not vllm.refusals(s, p), (p.errors, vllm.refusals(s, p))
    args = list(vllm.pod_command(s, p, 0, served_name="ds", leader=LEADER).args)
    # transformers routes DeepSeek-V3 by sigmoid scores and the correction bias whatever its config says; vLLM
    # reads it from topk_method and scoring_func, which save_pretrained leaves out
    assert json.loads(args[args.index("--hf-overrides") + 1]) == {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    mine = cpu_deepseek(("--hf-overrides", '{"topk_method": "noaux_tc", "scoring_func": "sigmoid", "x": 1}'))
    args = list(vllm.pod_command(mine, plan(mine), 0, served_name="ds", leader=LEADER).args)
    assert args.count("--hf-overrides") == 1 and args[-2:] == list(mine.runtime.args)  # the user's, not a second
    latent = cpu_deepseek(kvLoraRank=256)
    assert any("kv_lora_rank 512 + qk_rope_head_dim 64" in r and "256 + 64" in r
               for r in vllm.refusals(latent, plan(latent))), vllm.refusals(latent, plan(latent))
    narrow = cpu_deepseek(hiddenSize=48)
    assert any("divisible by 32" in r and "is 48" in r for r in vllm.refusals(narrow, plan(narrow)))
