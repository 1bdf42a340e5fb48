"""Every validation rule: a bad spec is rejected with its field path and the numbers that are wrong, and
all violations are reported at once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from shardwise.api import InferenceDeploymentSpec
from shardwise.planner import plan
from tests.conftest import make_spec

QWEN = {"model": {"preset": "Qwen3-235B-A22B"}, "hardware": {"gpu": "H200", "gpusPerNode": 8}}
TINY = {"model": {"preset": "tiny-moe"}, "hardware": {"gpu": "cpu", "gpusPerNode": 8}}
ODD_KV = {"numLayers": 2, "hiddenSize": 192, "vocabSize": 260, "numHeads": 12, "numKvHeads": 4, "headDim": 16,
          "intermediateSize": 256}

CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("q heads must divide by tp", {**TINY, "parallelism": {"tp": 3}}, "spec.parallelism.tp",
     "numHeads=4 is not divisible by tp=3"),
    ("kv heads must divide by tp when tp is smaller", {**TINY, "model": {"architecture": ODD_KV},
     "parallelism": {"tp": 3}}, "spec.parallelism.tp", "numKvHeads=4 is not divisible by tp=3"),
    ("tp beyond the kv heads must be a multiple of them", {**TINY, "model": {"architecture": ODD_KV},
     "parallelism": {"tp": 6}, "hardware": {"gpu": "cpu", "gpusPerNode": 6}}, "spec.parallelism.tp",
     "tp=6 > numKvHeads=4 needs tp % numKvHeads == 0 (remainder 2)"),
    ("pp beyond the layer count leaves an empty stage", {**TINY, "parallelism": {"pp": 5}}, "spec.parallelism.pp",
     "pp=5 exceeds numLayers=4"),
    ("expert slots must divide by ep", {**TINY, "parallelism": {"dpa": 3}}, "spec.parallelism.ep",
     "16 + 0 = 16 expert slots are not divisible by ep=3"),
    ("redundant experts that break the division are named", {**TINY, "parallelism": {"dpa": 4},
     "eplb": {"redundantExperts": 2}}, "spec.eplb.redundantExperts", "16 + 2 = 18 expert slots"),
    ("ep times moeTp must divide a stage", {**TINY, "parallelism": {"dpa": 4, "ep": 3}}, "spec.parallelism.ep",
     "ep * moeTp = 3 * 1 = 3 must divide the 4 ranks"),
    ("a dense model has no experts to split", {**TINY, "model": {"preset": "tiny-dense"},
     "parallelism": {"moeTp": 2}}, "spec.parallelism.moeTp", "moeTp=2 but the model has no experts"),
    ("a tp group larger than a node", {**QWEN, "parallelism": {"tp": 16}}, "spec.parallelism.tp",
     "tp=16 exceeds gpusPerNode=8"),
    ("a world that is not a whole number of nodes", {**QWEN, "parallelism": {"tp": 4, "dpa": 3}},
     "spec.hardware.gpusPerNode", "world size 12 (pp*dpa*cp*tp) is larger than gpusPerNode=8"),
    ("weights that do not fit", {**QWEN, "parallelism": {"tp": 1}}, "spec.parallelism",
     "weights + "),
    ("a kv pool smaller than one request", {**QWEN, "parallelism": {"tp": 4},
     "serving": {"maxModelLen": 2_000_000}}, "spec.serving.maxModelLen", "one request of maxModelLen=2000000"),
    ("zigzag needs a length divisible by 2 cp", {**TINY, "parallelism": {"cp": 4, "cpMode": "pcp",
     "cpLayout": "zigzag"}, "serving": {"maxModelLen": 100}}, "spec.parallelism.cpLayout",
     "maxModelLen=100, 2*cp=8"),
    ("zigzag cannot follow a growing decode sequence", {**TINY, "parallelism": {"cp": 2, "cpMode": "dcp",
     "cpLayout": "zigzag"}}, "spec.parallelism.cpLayout", "use striped"),
    ("contiguous needs a length divisible by cp", {**TINY, "parallelism": {"cp": 4, "cpLayout": "contiguous"},
     "serving": {"maxModelLen": 102}}, "spec.parallelism.cpLayout", "maxModelLen=102, cp=4"),
    ("dpa outside the elastic range", {**TINY, "parallelism": {"dpa": 8}, "elastic": {"minDpa": 1, "maxDpa": 4}},
     "spec.parallelism.dpa", "dpa=8 is outside elastic.minDpa..maxDpa = 1..4"),
    ("an unknown gpu preset", {**TINY, "hardware": {"gpu": "Z9000"}}, "spec.hardware.gpu",
     "unknown gpu preset 'Z9000'"),
]


@pytest.mark.parametrize("name,sections,field,fragment", CASES, ids=[c[0] for c in CASES])
def test_an_invalid_layout_is_rejected_with_its_field_and_numbers(
    name: str, sections: dict[str, Any], field: str, fragment: str
) -> None:
    p = plan(make_spec(**sections))
    assert not p.valid
    hits = [e for e in p.errors if e.field == field and fragment in e.message]
    assert hits, f"expected {field}: ...{fragment}... in {[str(e) for e in p.errors]}"


def test_every_violation_is_reported_at_once() -> None:
    p = plan(make_spec(**{**TINY, "parallelism": {"tp": 3, "pp": 5, "dpa": 9}, "elastic": {"maxDpa": 4}}))
    fields = {e.field for e in p.errors}
    assert {"spec.parallelism.tp", "spec.parallelism.pp", "spec.parallelism.dpa"} <= fields


@pytest.mark.parametrize("sections,field,fragment", [
    ({**QWEN, "parallelism": {"tp": 8}}, "spec.parallelism.tp", "replicated 2x; consider tp=4 with dpa=2"),
    ({**QWEN, "model": {"preset": "DeepSeek-V3"}, "parallelism": {"tp": 8}}, "spec.parallelism.tp",
     "MLA keeps one latent KV cache"),
    ({**TINY, "parallelism": {"cp": 2, "cpLayout": "contiguous"}}, "spec.parallelism.cpLayout", "unbalanced"),
    ({**TINY, "parallelism": {"pp": 3}}, "spec.parallelism.pp", "stages hold 1 or 2 layers"),
    ({**TINY, "parallelism": {"dpa": 2}, "eplb": {"minDistinct": 2}}, "spec.eplb.minDistinct",
     "redundantExperts >= numExperts=16"),
])
def test_a_valid_but_costly_layout_gets_a_warning(sections: dict[str, Any], field: str, fragment: str) -> None:
    p = plan(make_spec(**sections))
    assert any(w.field == field and fragment in w.message for w in p.warnings), [str(w) for w in p.warnings]


@pytest.mark.parametrize("body,loc", [
    ({"model": {"preset": "tiny-moe"}, "parallelism": {"tp": 0}}, ("parallelism", "tp")),
    ({"model": {"preset": "tiny-moe"}, "serving": {"memoryFraction": 1.5}}, ("serving", "memoryFraction")),
    ({"model": {}}, ("model",)),
    ({"model": {"preset": "tiny-moe"}, "parallelism": {"cpLayout": "spiral"}}, ("parallelism", "cpLayout")),
    ({"model": {"preset": "tiny-moe"}, "parallelism": {"tpp": 2}}, ("parallelism", "tpp")),
])
def test_malformed_fields_fail_schema_validation_at_their_path(body: dict[str, Any], loc: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError) as e:
        InferenceDeploymentSpec.model_validate(body)
    assert any(tuple(err["loc"][: len(loc)]) == loc for err in e.value.errors()), e.value.errors()


@pytest.mark.parametrize("resources,fragments", [
    ({"requests": {"cpu": "two"}}, ["requests.cpu: invalid quantity 'two'"]),
    ({"requests": {"memory": "64Gi"}, "limits": {"memory": "32Gi"}},
     ["requests.memory=64Gi exceeds limits.memory=32Gi"]),
    ({"limits": {"nvidia.com/gpu": "8"}},
     ["limits.nvidia.com/gpu: only cpu, memory, ephemeral-storage", "gpusPerNode"]),
    ({"requests": {"cpu": "-1", "memory": "1 GB"}},
     ["requests.cpu=-1 is negative", "requests.memory: invalid quantity"]),
])
def test_worker_resources_that_kubernetes_would_refuse_are_rejected_with_the_values(
        resources: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(ValidationError) as e:
        InferenceDeploymentSpec.model_validate({"model": {"preset": "tiny-moe"}, "runtime": {"resources": resources}})
    [err] = e.value.errors()
    assert err["loc"] == ("runtime", "resources")
    for fragment in fragments:
        assert fragment in err["msg"], err["msg"]


def test_an_inline_architecture_plans_like_the_preset_it_copies() -> None:
    from shardwise.presets import model_preset

    arch = model_preset("tiny-moe").model_dump(by_alias=True)
    inline = plan(make_spec(model={"architecture": arch}, parallelism={"tp": 2}))
    preset = plan(make_spec(parallelism={"tp": 2}))
    assert inline.valid and inline.model_name == "inline"
    assert inline.stage_ledger == preset.stage_ledger


def checkpoint_dir(directory: Path, **config: Any) -> str:
    """A checkpoint's config.json as Hugging Face writes it (the planner reads nothing else)."""
    body = {"model_type": "qwen3_moe", "vocab_size": 331, "hidden_size": 64, "intermediate_size": 80,
            "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
            "max_position_embeddings": 512, **config}
    (directory / "config.json").write_text(json.dumps({k: v for k, v in body.items() if v is not None}))
    return str(directory)


def on_checkpoint(path: str, engine: str, **serving: Any) -> InferenceDeploymentSpec:
    return make_spec(model={"source": {"path": path}, "dtype": "float32"}, hardware={"gpu": "cpu", "gpusPerNode": 2},
                     parallelism={"tp": 1, "dpa": 1}, serving=serving, runtime={"engine": engine})


@pytest.mark.parametrize("engine", ["reference", "vllm"])
def test_max_model_len_defaults_to_the_checkpoints_positions_and_may_not_pass_them(tmp_path: Path,
                                                                                   engine: str) -> None:
    from shardwise.operator import builders as b

    from shardwise import vllm

    path = checkpoint_dir(tmp_path)
    p = plan(on_checkpoint(path, engine))
    assert p.valid and p.max_model_len == 512 and p.to_dict()["maxModelLen"] == 512
    owner = {"metadata": {"name": "m", "namespace": "ml", "uid": "u"}}
    pod = b.build_pod(owner, p.spec, p, 0, world=1)
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["SHARDWISE_MAX_MODEL_LEN"] == "512"
    if engine == "vllm":
        args = vllm.pod_command(p.spec, p, 0, served_name="m", leader="m-0").args
        assert args[args.index("--max-model-len") + 1] == "512"  # what vLLM accepts for this model
    refused = plan(on_checkpoint(path, engine, maxModelLen=4096))
    assert [str(e) for e in refused.errors] == [
        "spec.serving.maxModelLen: 4096 exceeds the model's max_position_embeddings 512 "
        "(set at most 512, or leave it out to get 512)"]
    assert plan(on_checkpoint(path, engine, maxModelLen=512)).valid
    assert plan(on_checkpoint(path, engine, maxModelLen=128)).max_model_len == 128


def test_a_model_that_does_not_give_its_positions_gets_4096_and_no_limit(tmp_path: Path) -> None:
    path = checkpoint_dir(tmp_path, max_position_embeddings=None)
    assert plan(on_checkpoint(path, "reference")).max_model_len == 4096
    assert plan(on_checkpoint(path, "reference", maxModelLen=8192)).valid


@pytest.mark.parametrize("preset,positions", [("tiny-moe", 4096), ("Qwen3-235B-A22B", 40960),
                                              ("DeepSeek-V3", 163840), ("Llama-3.1-405B", 131072)])
def test_a_presets_positions_are_its_default_max_model_len_and_its_limit(preset: str, positions: int) -> None:
    hardware = {"gpu": "cpu" if preset.startswith("tiny") else "H200", "gpusPerNode": 8}
    p = plan(make_spec(model={"preset": preset}, hardware=hardware))
    assert p.max_model_len == positions
    over = plan(make_spec(model={"preset": preset}, hardware=hardware, serving={"maxModelLen": positions + 1}))
    assert f"spec.serving.maxModelLen: {positions + 1} exceeds the model's max_position_embeddings {positions}" in [
        str(e).split(" (")[0] for e in over.errors]
