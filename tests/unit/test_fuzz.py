"""Fuzzing what users and clients send: InferenceDeployment specs (through the planner and the admission webhook),
AdmissionReviews, and the OpenAI API's request bodies. Whatever arrives, the answer is a plan, a list of errors
with field paths, or the API's own error: never a traceback."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardwise.agents import openai_api as oai
from shardwise.operator.reconcile import spec_errors
from shardwise.operator.webhook import review_answer

from shardwise.presets import GPU_PRESETS, MODEL_PRESETS

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = yaml.safe_load((ROOT / "examples" / "tiny-moe.yaml").read_text())["spec"]
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# values of every JSON type, with the edges that break arithmetic: 0, negatives, huge numbers, NaN, long strings
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2, 3, 7, 64, 2**31, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.sampled_from(["", "H200", "cpu", "vllm", "reference", "pcp", "zigzag", "tiny-moe", "1e400", "NaN"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                      max_leaves=12)


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    return out


PATHS = _paths(EXAMPLE)[1:] + [("parallelism", k) for k in ("tp", "dpa", "pp", "cp", "ep", "moeTp", "cpMode")] + [
    ("model", "architecture"), ("model", "path"), ("runtime", "resources"), ("runtime", "args"),
    ("runtime", "engine"), ("hardware", "gpusPerNode"), ("elastic", "minDpa"), ("elastic", "maxDpa")]


@st.composite
def mutated_specs(draw: st.DrawFn) -> Any:
    """The example spec with a few fields replaced by anything, or anything at all instead of a spec."""
    if draw(st.integers(0, 9)) == 0:
        return draw(values)
    spec = copy.deepcopy(EXAMPLE)
    for path in draw(st.lists(st.sampled_from(PATHS), min_size=1, max_size=4)):
        node = spec
        for key in path[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[path[-1]] = draw(values)
    return spec


def plans_or_names_fields(raw: Any) -> None:
    spec, plan, errors = spec_errors(raw)
    assert all(isinstance(e, str) and e.startswith("spec.") for e in errors), errors
    if not errors:
        assert spec is not None and plan is not None and plan.valid


@FUZZ
@given(mutated_specs())
def test_any_spec_plans_or_is_refused_with_field_paths(raw: Any) -> None:
    plans_or_names_fields(raw)


small = st.integers(min_value=1, max_value=48)


@st.composite
def plausible_specs(draw: st.DrawFn) -> dict[str, Any]:
    """Well-typed specs over every preset and layout knob: they reach the planner's arithmetic."""
    low = draw(st.integers(1, 40))
    return {
        "model": {"preset": draw(st.sampled_from(sorted(MODEL_PRESETS)))},
        "hardware": {"gpu": draw(st.sampled_from(sorted(GPU_PRESETS))), "gpusPerNode": draw(st.integers(1, 16))},
        "parallelism": {"tp": draw(small), "dpa": draw(st.integers(low, low + 40)), "pp": draw(st.integers(1, 8)),
                        "cp": draw(st.integers(1, 8)), "ep": draw(st.none() | small), "moeTp": draw(st.integers(1, 8)),
                        "cpMode": draw(st.sampled_from(["pcp", "dcp"])),
                        "cpLayout": draw(st.sampled_from(["contiguous", "zigzag", "striped"]))},
        "serving": {"maxModelLen": draw(st.integers(1, 10**7))},
        "eplb": {"enabled": draw(st.booleans()), "redundantExperts": draw(st.integers(0, 300))},
        "elastic": {"minDpa": low, "maxDpa": draw(st.integers(low, 5000))},
        "runtime": {"engine": draw(st.sampled_from(["reference", "vllm"]))},
    }


@FUZZ
@given(plausible_specs())
def test_any_well_typed_layout_plans_or_is_refused_with_field_paths(raw: dict[str, Any]) -> None:
    plans_or_names_fields(raw)


@FUZZ
@given(st.one_of(values, mutated_specs().map(lambda spec: {"request": {
    "uid": "u", "operation": "CREATE", "object": {"spec": spec}}})))
def test_any_admission_review_is_answered_or_called_malformed(review: Any) -> None:
    try:
        answer = review_answer(review)
    except ValueError as e:
        assert str(e)
        return
    response = answer["response"]
    assert response["uid"] == review["request"]["uid"]
    assert response["allowed"] is True or response["status"]["code"] == 422
    json.dumps(answer)  # serialisable as it goes back


DEFAULTS = oai.Defaults(model="m", max_model_len=256, vocab_size=260)
REQUEST = {"model": "m", "prompt": "hi", "max_tokens": 4}


@FUZZ
@given(st.one_of(values, st.dictionaries(st.sampled_from(
    ["model", "prompt", "max_tokens", "temperature", "top_p", "stop", "stream", "seed", "n", "messages", "logprobs",
     "request_id", "stream_options", "ignore_eos", "min_tokens", "echo"]), values, max_size=6).map(
    lambda extra: {**REQUEST, **extra})))
def test_any_completion_or_chat_body_parses_or_gets_an_api_error(data: Any) -> None:
    for parse in (oai.parse_completion, oai.parse_chat):
        try:
            parse(data, DEFAULTS) if isinstance(data, dict) else oai.parse_json(json.dumps(data).encode())
        except oai.ApiError as e:
            assert 400 <= e.status < 500 and e.body()["error"]["message"]


@FUZZ
@given(st.binary(max_size=200))
def test_any_request_body_is_json_or_an_api_error(body: bytes) -> None:
    try:
        oai.parse_json(body)
    except oai.ApiError as e:
        assert e.status == 400
