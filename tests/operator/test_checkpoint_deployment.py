"""An InferenceDeployment of a Hugging Face checkpoint on the local cluster: `model.source.path` only (the
operator reads config.json to plan), kubectl in, pods serving the OpenAI API out, answers equal to
transformers' greedy tokens through the official client; a checkpoint that is not the planned model is
refused by the pods and reported as InvalidSpec with the numbers, with no crash loop."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kopf")
pytest.importorskip("kmock")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from shardwise.devcluster.session import LocalSession  # noqa: E402

from shardwise import checkpoint  # noqa: E402
from tests.checkpoints import greedy, make_checkpoint  # noqa: E402
from tests.operator.common import (  # noqa: E402
    apply,
    assert_serves_like_the_oracle,
    delete,
    events,
    local_session,
    pods,
    wait_available,
    wait_status,
)
from tests.operator.common import manifest as preset_manifest  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    yield from local_session(tmp_path_factory, "checkpoints", operator_args=("--gang-timeout", "120"))


def manifest(name: str, directory: Path, **model: Any) -> str:
    return yaml.safe_dump({
        "apiVersion": "shardwise.io/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": name},
        "spec": {"model": {"source": {"path": str(directory)}, "dtype": "float64", **model},
                 "hardware": {"gpu": "cpu", "gpusPerNode": 2}, "parallelism": {"tp": 2, "dpa": 2},
                 "serving": {"maxModelLen": 128, "maxBatchTokens": 256, "workspaceMib": 64},
                 "elastic": {"minDpa": 1, "maxDpa": 2}}})


EXPERTS = {"qwen3_moe": {"num_experts": 8}, "mixtral": {"num_local_experts": 8},  # 8 experts over ep 4
           "deepseek_v3": {"n_routed_experts": 8, "n_group": 2}}  # MLA, YaRN, group-limited sigmoid routing


@pytest.mark.parametrize("family", list(EXPERTS))
def test_a_checkpoint_named_by_path_serves_transformers_tokens_to_the_openai_client(
        session: LocalSession, tmp_path: Path, family: str) -> None:
    s, name = session, f"hf-{family.replace('_', '-')}"
    experts = EXPERTS[family]
    directory = make_checkpoint(tmp_path / family, family, **experts)
    apply(s, manifest(name, directory))
    st = wait_available(s, name)
    assert st["dpa"] == 2 and st["worldSize"] == 4 and len(st["endpoints"]) == 2
    pod = pods(s, name)[0]
    model = [v for v in pod["spec"]["volumes"] if v["name"] == "model"]
    assert model == [{"name": "model", "hostPath": {"path": str(directory), "type": "Directory"}}]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    for url, prompt in zip([*st["endpoints"], st["url"]], ["hello world", "elastic expert parallel", "routed"],
                           strict=True):
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in c.models.list()] == [name]
        r = c.completions.create(model=name, prompt=prompt, max_tokens=10, temperature=0)
        assert r.choices[0].model_extra["token_ids"] == greedy(directory, tok(prompt)["input_ids"], 10)
    delete(s, name)


def test_pods_refuse_a_checkpoint_that_is_not_the_planned_model_as_invalid_spec(session: LocalSession,
                                                                                tmp_path: Path) -> None:
    s = session
    directory = make_checkpoint(tmp_path / "qwen3", "qwen3")
    planned = checkpoint.inspect(directory).architecture.model_dump(mode="json", by_alias=True)
    planned["numKvHeads"] = 6  # what the user believed: the checkpoint has 3
    apply(s, manifest("wrong-kv", directory, architecture=planned))
    st = wait_status(s, "wrong-kv", lambda st: st.get("phase") == "Failed", "wrong-kv to fail")
    conds = {c["type"]: c for c in st["conditions"]}
    assert conds["Available"]["reason"] == "InvalidSpec"
    assert "numKvHeads: planned 6, checkpoint 3" in conds["Available"]["message"]
    s.wait_for(lambda: not pods(s, "wrong-kv"), 60, "the refused world's pods to go")
    assert any(e["reason"] == "InvalidSpec" and "numKvHeads" in e["message"] for e in events(s, "wrong-kv"))
    # no crash loop: the refusal is kept for this spec generation, so no pod is recreated
    assert s.status("wrong-kv")["checkpointRefused"]["generation"] == s.get(
        "inferencedeployments.shardwise.io", "wrong-kv")["metadata"]["generation"]
    assert not pods(s, "wrong-kv")
    delete(s, "wrong-kv")


def test_moe_tp_experts_split_over_two_ranks_serve_like_the_oracle_and_scale_in_place(session: LocalSession) -> None:
    s = session
    apply(s, preset_manifest("moetp", moeTp=2, dpa=2))  # tiny-moe: tp 2 x dpa 2, each expert on 2 ranks, ep 2
    st = wait_available(s, "moetp")
    assert st["worldSize"] == 4
    assert_serves_like_the_oracle(st, "split experts")
    s.kubectl("scale", "idep/moetp", "--replicas", "4")
    st = wait_available(s, "moetp", world_above=st["worldGeneration"], dpa=4)  # ep 4 over 8 ranks
    assert_serves_like_the_oracle(st, "split experts, scaled")
    delete(s, "moetp")


# the operator carries cpMode, cpLayout, cpComm and maxModelLen (contiguous decode CP cuts it into ranges) to the
# pods; every mode, layout and merge is checked against transformers in tests/runtime/test_context.py
CP_LAYOUTS = [{"cpMode": "pcp", "cpLayout": "zigzag"}, {"cpMode": "dcp", "cpLayout": "contiguous"},
              {"cpMode": "dcp", "cpLayout": "striped", "cpComm": "a2a"}]


@pytest.mark.parametrize("cp", CP_LAYOUTS, ids=[" ".join(c.values()) for c in CP_LAYOUTS])
def test_context_parallel_deployments_serve_like_the_oracle(session: LocalSession, cp: dict[str, str]) -> None:
    s = session
    name = f"cp-{cp['cpMode']}-{cp['cpLayout']}"
    apply(s, preset_manifest(name, cp=2, dpa=1, **cp))  # tiny-moe: tp 2 x cp 2, one DPA group over 2 pods
    st = wait_available(s, name)
    assert st["worldSize"] == 4 and len(st["endpoints"]) == 1
    assert_serves_like_the_oracle(st, "a sequence split over two ranks")
    delete(s, name)
