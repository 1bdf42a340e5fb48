"""engine vllm on the local cluster, with real vLLM processes (its CPU build): an InferenceDeployment of a
transformers-made checkpoint becomes Available, its endpoint answers with transformers' greedy tokens (float32,
what vLLM computes in here), a deleted pod is recovered by re-forming the world and answers again, and the
autoscaler reads vLLM's own metrics through a real Prometheus and decides to scale up, which is as far as vLLM's CPU
build goes (data parallel MoE is refused with its reason while dpa 1 keeps serving); and a flag vLLM refuses
shows as Degraded with vLLM's own error line while the agent restarts it.

One vLLM start takes 30-60 s on two cores, so the steps share one deployment, in order."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("kopf")
pytest.importorskip("kmock")
openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from shardwise.devcluster.prometheus import PrometheusMissing, find_binary  # noqa: E402
from shardwise.devcluster.session import LocalSession  # noqa: E402

from tests.checkpoints import greedy, make_checkpoint  # noqa: E402
from tests.operator.common import apply, available, delete, events, local_session, pods, wait_status  # noqa: E402
from tests.vllm_env import SKIP_REASON, vllm_python  # noqa: E402

pytestmark = pytest.mark.slow
NAME = "vllm-moe"
START_S = 300  # a vLLM start on a busy 2-core machine, with the pod's own start
LONG = 500  # tokens of the request in flight during a roll: most of maxModelLen (512), so it is seen in flight


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSession]:
    python = vllm_python()
    if python is None:
        pytest.skip(SKIP_REASON)
    try:
        find_binary()
    except PrometheusMissing as e:
        pytest.skip(str(e))
    # no variable set here: the local cluster finds the vLLM environment `make install` built on its own (a
    # SHARDWISE_VLLM_PYTHON a user set, which vllm_python() honours too, reaches the pods with the environment)
    yield from local_session(tmp_path_factory, "vllm", nodes=1, gpus_per_node=2, prometheus=True,
                             operator_env={"SHARDWISE_EPLB_CHECK_SECONDS": "3600"})


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # vLLM's CPU MoE kernels want a hidden size divisible by 32 (and CPU attention a head dim of 32 or more)
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3-moe", "qwen3_moe", hidden_size=64)


def manifest(directory: Path, autoscaling: dict[str, Any] | None = None) -> str:
    spec: dict[str, Any] = {
        "model": {"source": {"path": str(directory)}, "dtype": "float32"},
        "hardware": {"gpu": "cpu", "gpusPerNode": 2}, "parallelism": {"tp": 1, "dpa": 1},
        # maxModelLen left out: the checkpoint's max_position_embeddings (512), which vLLM accepts
        "serving": {"maxBatchTokens": 512, "workspaceMib": 64, "memoryFraction": 0.3},
        "elastic": {"minDpa": 1, "maxDpa": 2, "scaleDown": {"drainTimeoutSeconds": 60}},
        "runtime": {"engine": "vllm"}}
    if autoscaling:
        spec["autoscaling"] = autoscaling
    return yaml.safe_dump({"apiVersion": "shardwise.io/v1alpha1", "kind": "InferenceDeployment",
                           "metadata": {"name": NAME}, "spec": spec})


def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def assert_answers_like_transformers(st: dict[str, Any], directory: Path, prompt: str) -> None:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(directory))(prompt)["input_ids"]
    (url,) = st["endpoints"]
    for base in (url, st["url"]):  # the pod, and the deployment's router in front of it
        c = client(base)
        assert [m.id for m in c.models.list()] == [NAME]
        r = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                 extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == greedy(directory, ids, 12, "float32")


def test_a_vllm_deployment_serves_recovers_and_autoscales_from_vllms_metrics(
        session: LocalSession, checkpoint_dir: Path) -> None:
    s = session
    assert s.prometheus is not None
    autoscaling = {"enabled": True, "prometheusUrl": s.prometheus.url, "targetPerDpa": 1.0,
                   "stabilizationWindowSeconds": 0, "cooldownSeconds": 3600, "intervalSeconds": 1}  # one decision
    apply(s, manifest(checkpoint_dir))  # autoscaling comes once it serves: the first steps hold dpa 1
    st = wait_status(s, NAME, available, f"{NAME} Available", timeout=START_S)
    assert st["engine"]["name"] == "vllm" and "re-form" in st["engine"]["operations"]["scale"]
    (pod,) = pods(s, NAME)
    args = pod["spec"]["containers"][0]["args"]
    assert pod["spec"]["containers"][0]["command"] == ["shardwise", "agent", "--engine", "vllm", "--"]
    assert args[:2] == ["--model", str(checkpoint_dir)] and "--enforce-eager" in args
    assert_answers_like_transformers(st, checkpoint_dir, "hello world")

    # a deleted pod: the world is re-formed with a new pod and a new vLLM, which answers the same
    world = st["worldGeneration"]
    s.kubectl("delete", "pod", pod["metadata"]["name"], "--wait=false")
    st = wait_status(s, NAME, lambda st: available(st) and st["worldGeneration"] > world,
                     "a new world after the pod's deletion", timeout=START_S)
    assert_answers_like_transformers(st, checkpoint_dir, "elastic expert parallel")

    # load read from vLLM's series through Prometheus: the autoscaler asks for a second group
    apply(s, manifest(checkpoint_dir, autoscaling))
    (url,) = st["endpoints"]
    answers: list[int] = []
    stop = threading.Event()

    def load() -> None:
        c = client(url)
        while not stop.is_set():
            try:
                c.completions.create(model=NAME, prompt="the quick brown fox", max_tokens=400, temperature=0,
                                     extra_body={"ignore_eos": True})
                answers.append(200)
            except openai.APIStatusError as e:
                answers.append(e.status_code)
                return  # the pod stopped admitting (503): the roll to the new size has begun
            except openai.APIConnectionError:
                answers.append(0)
                return

    clients = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for t in clients:
        t.start()
    try:
        wait_status(s, NAME, lambda st: (st.get("autoscaling") or {}).get("desiredDpa") == 2,
                    "an autoscaling decision to dpa 2", timeout=180)
    finally:
        stop.set()
        for t in clients:
            t.join(180)
    assert any(e["reason"] == "AutoscaleUp" for e in events(s, NAME))
    assert answers and set(answers) == {200}, answers

    # dpa 2 of a MoE model is what vLLM's CPU build cannot run (no all_gatherv for data parallel MoE steps):
    # the autoscaler's change is refused with that reason, and the world keeps serving at dpa 1
    def refused(st: dict[str, Any]) -> bool:
        return any(c["type"] == "Progressing" and c["reason"] == "InvalidSpec" and "CPU build" in c["message"]
                   for c in st.get("conditions") or [])

    st = wait_status(s, NAME, refused, "the dpa-2 change refused with vLLM's CPU rule", timeout=60)
    assert available(st) and st["dpa"] == 1
    assert_answers_like_transformers(st, checkpoint_dir, "a router sends each request")

    # a flag vLLM refuses: the roll drains the old pod first (a long request in flight finishes whole), then the
    # new vLLM fails to start, the agent restarts it with backoff, and the deployment says why with vLLM's line
    # The request streams, and its reader holds after the first chunk until the patch is applied, so the request is
    # in flight from the client's side when the roll begins, however slowly a busy machine decodes or scrapes
    long: list[Any] = []
    first, patched = threading.Event(), threading.Event()

    def send_long() -> None:
        try:
            tokens = 0
            for chunk in client(url).completions.create(
                    model=NAME, prompt="hello world", max_tokens=LONG, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                if not first.is_set():
                    first.set()
                    patched.wait(120)
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            long.append(tokens)
        except Exception as e:  # kept for the assertion below (a thread's exception is otherwise lost)
            long.append(e)
        finally:
            first.set()

    streaming = threading.Thread(target=send_long)
    streaming.start()
    assert first.wait(120), "no first chunk of the long request in 120 s"
    assert not long, long  # it streams, not already over (nor failed)
    s.kubectl("patch", "inferencedeployment", NAME, "--type", "merge", "-p",
              '{"spec": {"parallelism": {"dpa": 1}, "autoscaling": {"enabled": false}, '
              '"runtime": {"args": ["--no-such-flag", "1"]}}}')
    patched.set()
    streaming.join(120)
    assert long == [LONG], long  # drained, not cut

    def restarting(st: dict[str, Any]) -> bool:
        return any(c["type"] == "Degraded" and c["status"] == "True" and c["reason"] == "EngineRestarting"
                   for c in st.get("conditions") or [])

    st = wait_status(s, NAME, restarting, "vLLM's refusal reported as Degraded", timeout=START_S)
    message = next(c["message"] for c in st["conditions"] if c["type"] == "Degraded")
    assert "vLLM exited with code" in message and "unrecognized arguments: --no-such-flag" in message, message
    assert not available(st)
    assert any(e["reason"] == "EngineRestarting" for e in events(s, NAME))
    delete(s, NAME)


def test_a_deepseek_v3_checkpoint_served_by_vllm_answers_transformers_tokens(
        session: LocalSession, tmp_path_factory: pytest.TempPathFactory) -> None:
    """MLA and DeepSeek's routing in vLLM's CPU build: a transformers-made DeepSeek-V3 checkpoint (its config
    without topk_method and scoring_func, as save_pretrained writes it) with the latent vLLM's CPU kernel computes
    (512 + 64), served through the operator, returns transformers' float32 greedy tokens."""
    s, name = session, "vllm-mla"
    directory = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "deepseek-v3", "deepseek_v3", hidden_size=64,
                                kv_lora_rank=512, qk_rope_head_dim=64)
    body = yaml.safe_load(manifest(directory))
    body["metadata"]["name"] = name
    apply(s, yaml.safe_dump(body))
    st = wait_status(s, name, available, f"{name} Available", timeout=START_S)
    (pod,) = pods(s, name)
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--hf-overrides") + 1] == '{"topk_method":"noaux_tc","scoring_func":"sigmoid"}'
    from transformers import AutoTokenizer

    for prompt in ("hello world", "attention groups serve"):
        ids = AutoTokenizer.from_pretrained(str(directory))(prompt)["input_ids"]
        r = client(st["url"]).completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                                 extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == greedy(directory, ids, 12, "float32"), prompt
    delete(s, name)
