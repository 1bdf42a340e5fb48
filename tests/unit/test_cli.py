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


def search_args(*more: str) -> list[str]:
    return ["plan", "--search", "--model", "tiny-moe", "--gpu", "cpu", "--gpus", "4", *more]


def test_a_searched_layout_is_written_as_a_deployment_that_plans_valid(tmp_path: Path) -> None:
    front = json.loads(run(*search_args("-o", "json")).stdout)["front"]
    for pick in (1, len(front)):
        out = run(*search_args("-o", "manifest", "--pick", str(pick), "--name", "picked"))
        assert out.returncode == 0, out.stderr
        doc = yaml.safe_load(out.stdout)
        assert doc["kind"] == "InferenceDeployment" and doc["metadata"]["name"] == "picked"
        row = front[pick - 1]
        par = doc["spec"]["parallelism"]
        assert (par["tp"], par["dpa"], par["pp"], par.get("cp", 1), par.get("moeTp", 1)) == \
            (row["tp"], row["dpa"], row["pp"], row["cp"], row["moeTp"])
        assert doc["spec"]["serving"]["maxRunning"] == row["batch"]
        path = tmp_path / f"picked-{pick}.yaml"
        path.write_text(out.stdout)
        again = run("plan", str(path), "-o", "json")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["worldSize"] == 4


def test_the_search_table_numbers_the_rows_a_manifest_can_pick() -> None:
    out = run(*search_args())
    assert out.returncode == 0, out.stderr
    assert "-o manifest --pick N" in out.stdout and "│  1 │" in out.stdout


@pytest.mark.parametrize("args,fragment", [
    pytest.param(search_args("--batch", "8"), "--batch does not apply to --search", id="batch with search"),
    pytest.param(search_args("--phase", "prefill", "--diagram", "x.svg"), "--phase, --diagram do not apply",
                 id="phase and diagram with search"),
    pytest.param(["plan", "examples/tiny-moe.yaml", "--gpus", "8"], "--gpus applies only to --search",
                 id="a search flag with a file"),
    pytest.param(["plan", "examples/tiny-moe.yaml", "-o", "manifest"], "-o manifest writes a layout found by --search",
                 id="manifest of a file"),
    pytest.param(search_args("--pick", "2"), "--pick applies only to -o manifest", id="pick without manifest"),
    pytest.param(search_args("-o", "manifest", "--pick", "99"), "--pick 99: the Pareto front has", id="pick too far"),
    pytest.param(search_args("-o", "manifest", "--name", "Tiny_MoE"), "--name 'Tiny_MoE': lowercase", id="bad name"),
    pytest.param(["plan", "--search", "--model", "tiny-moe", "--gpu", "H300", "--gpus", "8"],
                 "--gpu: unknown gpu preset 'H300'", id="unknown gpu of a search"),
])
def test_flags_that_do_not_apply_are_refused_not_ignored(args: list[str], fragment: str) -> None:
    out = run(*args)
    assert out.returncode == 1 and fragment in out.stderr, out.stderr


def test_an_unknown_gpu_in_a_file_names_its_field(tmp_path: Path) -> None:
    out = run("plan", str(write(tmp_path, {"model": {"preset": "tiny-moe"}, "hardware": {"gpu": "H300"}})))
    assert out.returncode == 1 and "error: spec.hardware.gpu: unknown gpu preset 'H300'" in out.stderr, out.stderr


def test_a_misspelled_field_gets_a_did_you_mean(tmp_path: Path) -> None:
    spec = {"model": {"preset": "tiny-moe"}, "hardware": {"gpu": "cpu", "gpuPerNode": 2,
                                                            "tolerations": [{"key": "a", "efect": "NoSchedule"}]},
            "servng": {}}
    out = run("plan", str(write(tmp_path, spec)))
    assert out.returncode == 2
    assert "spec.hardware.gpuPerNode: unknown field; did you mean 'gpusPerNode'?" in out.stderr, out.stderr
    assert "spec.hardware.tolerations.0.efect: unknown field; did you mean 'effect'?" in out.stderr
    assert "spec.servng: unknown field; did you mean 'serving'?" in out.stderr


def memory_error(tmp_path: Path, spec: dict[str, object]) -> str:
    out = run("plan", str(write(tmp_path, spec)))
    assert out.returncode == 2, out.stderr
    return next(line for line in out.stderr.splitlines() if "more than its budget" in line)


def test_weights_that_do_not_fit_get_the_smallest_changes_that_do_with_numbers(tmp_path: Path) -> None:
    dense = memory_error(tmp_path, {"model": {"preset": "Llama-3.1-405B"}, "hardware": {"gpu": "H100"},
                                    "parallelism": {"tp": 8}})
    assert "it fits with dtype fp8 (8 GPUs, 48.62 GiB fixed per rank) or pp=2 (16 GPUs" in dense, dense
    assert "tp=" not in dense.split("it fits")[1] and "dpa=" not in dense  # tp is at the node's 8; dense: no ep
    for change in ({"model": {"preset": "Llama-3.1-405B", "dtype": "fp8"}, "parallelism": {"tp": 8}},
                   {"model": {"preset": "Llama-3.1-405B"}, "parallelism": {"tp": 8, "pp": 2}}):
        assert run("plan", str(write(tmp_path, {"hardware": {"gpu": "H100"}, **change}))).returncode == 0
    moe = memory_error(tmp_path, {"model": {"preset": "DeepSeek-V3"}, "hardware": {"gpu": "H100"},
                                  "parallelism": {"tp": 8}})
    assert "pp=3 (24 GPUs" in moe and "dpa=4 (ep 32, 32 GPUs" in moe, moe
    hopeless = memory_error(tmp_path, {"model": {"preset": "DeepSeek-V3", "dtype": "fp8"},
                                       "hardware": {"gpu": "cpu", "gpusPerNode": 2}})
    assert "no single change (more tp, more pp, more dpa) fits on cpu: use a larger GPU" in hopeless, hopeless


def test_the_table_folds_dimensions_that_are_not_split_and_hides_experts_of_a_dense_model() -> None:
    out = run("plan", "examples/llama-405b-long-context.yaml")
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("│")]
    assert any("cp" in r and "1 rank each (16 groups): not split" in r for r in rows), out.stdout
    assert not any(r.split("│")[1].strip() in ("ep", "moeTp") for r in rows)
    assert "dense, no experts" in out.stdout and "{0} {1}" not in out.stdout


def test_the_diagram_has_a_colour_key_matching_its_boxes(tmp_path: Path) -> None:
    import re

    target = tmp_path / "plan.svg"
    assert run("plan", "examples/qwen3-235b-h200.yaml", "--diagram", str(target)).returncode == 0
    text = target.read_text()
    assert "fill: TP group" in text and "top band: DPA group" in text
    for label in ("TP 3", "DPA 3", "PP 0"):
        assert f">{label}</text>" in text
    swatches = re.findall(r'<rect [^>]*width="14.0" [^>]*fill="(#[0-9a-f]{6})"', text)
    boxes = set(re.findall(r'<rect [^>]*width="118.0" [^>]*fill="(#[0-9a-f]{6})"', text))
    bands = set(re.findall(r'<rect [^>]*width="118.0" height="8.0" fill="(#[0-9a-f]{6})"', text))
    assert len(swatches) == 4 + 4 + 1  # one per TP group, DPA group and PP stage of this plan
    assert set(swatches) == boxes | bands  # each swatch is a colour the boxes and bands use, and none is missing
