"""`shardwise plan` as a user runs it: the JSON contract, exit codes 0/2/1, diagrams, search."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from shardwise.presets import MODEL_PRESETS
from tests.conftest import shardwise_command

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*shardwise_command(), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def write(tmp: Path, spec: dict[str, object], name: str = "dep") -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"apiVersion": "shardwise.io/v1alpha1", "kind": "InferenceDeployment",
                                    "metadata": {"name": name}, "spec": spec}))
    return path


LEDGER_KEYS = {"rank", "weightsBytes", "kvCacheBytes", "kvBytesPerToken", "activationBytes", "workspaceBytes",
               "totalBytes", "freeBytes", "kvCapacityTokens"}
RANK_KEYS = {"rank", "pod", "gpu", "tpRank", "cpRank", "dpaGroup", "ppStage", "epRank"}
TRAFFIC_KEYS = {"tpAllReduceBytesPerRank", "tpAllReducesPerStep", "epAllToAllBytesPerRank", "cpBytesPerRank",
                "ppSendBytesPerRank"}


def test_json_output_carries_the_documented_contract() -> None:
    out = run("plan", "examples/tiny-moe.yaml", "--output", "json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["valid"] is True and d["errors"] == []
    assert (d["worldSize"], d["podCount"], d["gpusPerPod"]) == (4, 2, 2)
    assert set(d["groups"]) >= {"tp", "cp", "dpa", "pp", "ep"}
    assert d["groups"]["tp"] == [[0, 1], [2, 3]]
    assert all(set(r) >= RANK_KEYS for r in d["ranks"]) and len(d["ranks"]) == 4
    assert all(set(r) >= LEDGER_KEYS for r in d["ledger"]) and len(d["ledger"]) == 4
    assert all(isinstance(r["weightsBytes"], int) for r in d["ledger"])
    assert set(d["traffic"]) >= TRAFFIC_KEYS
    assert {"stepSeconds", "computeSeconds", "memorySeconds", "commSeconds"} <= set(d["estimates"])


@pytest.mark.parametrize("model", sorted(MODEL_PRESETS))
def test_every_model_preset_plans_to_json_on_h200(tmp_path: Path, model: str) -> None:
    dtype = "fp8" if model == "DeepSeek-V3" else "bfloat16"  # DeepSeek-V3 ships FP8; BF16 needs 16 GPUs
    spec = {"model": {"preset": model, "dtype": dtype}, "hardware": {"gpu": "H200"},
            "parallelism": {"tp": 1 if model.startswith("tiny") else 8, "pp": 2 if "405B" in model else 1}}
    out = run("plan", str(write(tmp_path, spec)), "-o", "json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["valid"] is True


def test_an_invalid_spec_exits_2_with_one_line_per_violation(tmp_path: Path) -> None:
    spec = {"model": {"preset": "tiny-moe"}, "hardware": {"gpu": "cpu"}, "parallelism": {"tp": 3, "pp": 9}}
    out = run("plan", str(write(tmp_path, spec)), "-o", "json")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    d = json.loads(out.stdout)
    assert d["valid"] is False
    assert len(lines) == len(d["errors"]) >= 2 and all(line.startswith("error: spec.") for line in lines)
    assert "error: spec.parallelism.tp: numHeads=4 is not divisible by tp=3" in lines


def test_a_schema_error_exits_2_with_the_field_path(tmp_path: Path) -> None:
    out = run("plan", str(write(tmp_path, {"model": {"preset": "tiny-moe"}, "parallelism": {"tp": -2}})))
    assert out.returncode == 2
    assert "spec.parallelism.tp" in out.stderr and "greater than or equal to 1" in out.stderr


@pytest.mark.parametrize("args,fragment", [
    (["plan", "missing.yaml"], "cannot read missing.yaml"),
    (["plan", "--search", "--model", "GPT-9", "--gpu", "H200", "--gpus", "8"], "unknown model preset 'GPT-9'"),
    (["plan", "--search", "--model", "tiny-moe"], "--search needs --gpu, --gpus"),
    (["plan"], "give a FILE.yaml"),
    (["plan", "examples/tiny-moe.yaml", "--phase", "train"], "'train' is not one of"),
])
def test_bad_usage_exits_1_with_a_one_line_message_and_no_traceback(args: list[str], fragment: str) -> None:
    out = run(*args)
    assert out.returncode == 1
    assert fragment in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_an_unknown_preset_in_a_file_is_bad_usage(tmp_path: Path) -> None:
    out = run("plan", str(write(tmp_path, {"model": {"preset": "GPT-9"}})))
    assert out.returncode == 1 and "unknown model preset 'GPT-9'" in out.stderr


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))
DEPLOYMENT = "apiVersion: shardwise.io/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: %s}\n" \
             "spec: {model: {preset: tiny-moe}, hardware: {gpu: cpu}}\n"


@pytest.mark.parametrize("content,fragment", [
    pytest.param(BOMB.encode(), "uses 72 YAML aliases; at most 64 are accepted", id="an alias expansion bomb"),
    pytest.param(b"kind: InferenceDeployment\nspec: \xff\xfe\n", "is not UTF-8 text: byte 0xff at offset 32",
                 id="not UTF-8"),
    pytest.param(((DEPLOYMENT % "a") + "---\n" + (DEPLOYMENT % "b")).encode(),
                 "holds 2 InferenceDeployments (documents 1, 2): plan one file per deployment", id="two deployments"),
    pytest.param(b"# " + b"x" * (1 << 20) + b"\n", "a manifest is at most 1,048,576", id="over the object limit"),
])
def test_a_manifest_that_cannot_be_one_deployment_is_refused_in_one_line(tmp_path: Path, content: bytes,
                                                                         fragment: str) -> None:
    path = tmp_path / "m.yaml"
    path.write_bytes(content)
    out = run("plan", str(path))
    assert out.returncode == 1 and fragment in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and len(out.stderr) < 400


@pytest.mark.parametrize("spec,fragment", [
    pytest.param({"model": {"preset": "tiny-moe"}, "parallelism": {"tp": True}}, "tp must be a number, got true",
                 id="a boolean for a number"),
    pytest.param({"model": {"architecture": {"numLayers": 2, "hiddenSize": 4, "vocabSize": 64, "numHeads": 8,
                                             "intermediateSize": 16}}},
                 "hiddenSize 4 is smaller than numHeads 8", id="heads of zero dimensions"),
    pytest.param({"model": {"architecture": {"numLayers": 2, "hiddenSize": 64, "vocabSize": 64, "numHeads": 8,
                                             "numKvHeads": 3, "intermediateSize": 16}}},
                 "numHeads 8 is not a multiple of numKvHeads 3", id="uneven kv heads"),
])
def test_an_impossible_spec_is_refused_by_field_never_by_a_traceback(tmp_path: Path, spec: dict[str, object],
                                                                      fragment: str) -> None:
    out = run("plan", str(write(tmp_path, spec)))
    assert out.returncode == 2 and fragment in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_a_file_that_is_not_yaml_is_bad_usage(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("spec: [unclosed\n")
    out = run("plan", str(bad))
    assert out.returncode == 1 and "not valid YAML" in out.stderr


@pytest.mark.parametrize("suffix,magic", [(".svg", b"<svg"), (".png", b"\x89PNG")])
def test_diagram_draws_every_gpu_of_every_pod(tmp_path: Path, suffix: str, magic: bytes) -> None:
    target = tmp_path / f"plan{suffix}"
    out = run("plan", "examples/qwen3-235b-h200.yaml", "--diagram", str(target))
    assert out.returncode == 0, out.stderr
    data = target.read_bytes()
    assert data.startswith(magic)
    if suffix == ".svg":
        text = data.decode()
        assert text.count("GPU ") == 16 and "pod 1" in text and "DPA 3" in text


def test_search_prints_a_pareto_front_as_json() -> None:
    out = run("plan", "--search", "--model", "Qwen3-30B-A3B", "--gpu", "H100", "--gpus", "8", "-o", "json")
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["layoutsValid"] > 0 and d["front"]
    assert all(p["tp"] * p["dpa"] * p["pp"] * p["cp"] == 8 for p in d["front"])


def test_the_table_output_names_the_plan_and_its_warnings() -> None:
    out = run("plan", "examples/tiny-moe.yaml", "--batch", "8", "--phase", "prefill", "--context", "128")
    assert out.returncode == 0, out.stderr
    assert "tiny-moe" in out.stdout and "memory ledger per rank" in out.stdout
    assert "one prefill step, batch 8 per group" in " ".join(out.stdout.split())


def test_plan_refuses_what_vllm_cannot_run_for_a_vllm_deployment(tmp_path: Path) -> None:
    f = tmp_path / "v.yaml"
    f.write_text("apiVersion: shardwise.io/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: v}\n"
                 "spec:\n  model: {preset: tiny-moe, dtype: float64}\n  hardware: {gpu: cpu, gpusPerNode: 2}\n"
                 "  runtime: {engine: vllm}\n")
    out = run("plan", str(f))
    assert out.returncode != 0
    assert "spec.model.source: engine vllm serves a checkpoint" in out.stderr
    assert "spec.model.dtype: vLLM computes in bfloat16, float16 or float32, not float64" in out.stderr
