"""A user's load query scoped to its deployment: every vector selector gets the deployment's matchers, nothing
else changes, and what cannot be scoped is refused with the offset (Prometheus' own parser checks the rewritten
queries in tests/devcluster/test_autoscaler_prometheus.py)."""

from __future__ import annotations

import pytest

from shardwise.planner import plan
from shardwise.promql import MAX_QUERY, PromQLError, scope
from tests.conftest import make_spec

S = 'deployment="llm",namespace=~"prod|"'


@pytest.mark.parametrize(("query", "scoped"), [
    ("up", f"up{{{S}}}"),
    ('up{job="w"}', f'up{{{S},job="w"}}'),
    ("up{}", f"up{{{S}}}"),
    ('{__name__=~"shardwise_.+"}', f'{{{S},__name__=~"shardwise_.+"}}'),
    ("vllm:num_requests_running", f"vllm:num_requests_running{{{S}}}"),
    ("sum by (dpa_group) (x)", f"sum by (dpa_group) (x{{{S}}})"),
    ("sum(x) without (pod, dpa_group)", f"sum(x{{{S}}}) without (pod, dpa_group)"),
    ("a / on(pod) group_left(dpa_group) b", f"a{{{S}}} / on(pod) group_left(dpa_group) b{{{S}}}"),
    ("rate(x[5m:30s] offset 1h)", f"rate(x{{{S}}}[5m:30s] offset 1h)"),
    ("x > bool 2 and y unless z", f"x{{{S}}} > bool 2 and y{{{S}}} unless z{{{S}}}"),
    ('label_replace(x, "dst", "$1", "src", "(.*)")', f'label_replace(x{{{S}}}, "dst", "$1", "src", "(.*)")'),
    ('x # up{job="commented"}', f'x{{{S}}} # up{{job="commented"}}'),
    ("vector(1) + 2.5e3 * Inf", "vector(1) + 2.5e3 * Inf"),
])
def test_every_selector_and_only_selectors_get_the_deployments_matchers(query: str, scoped: str) -> None:
    assert scope(query, "llm", "prod") == scoped


def test_without_a_namespace_the_scope_is_the_deployment_name() -> None:
    assert scope("up", "llm", "") == 'up{deployment="llm"}'


def test_a_quote_in_the_deployment_name_stays_inside_the_matcher() -> None:
    assert scope("up", 'a"}or{b', "") == 'up{deployment="a\\"}or{b"}'


@pytest.mark.parametrize(("query", "message"), [
    ('x{deployment="other"}', "the matcher on 'deployment' at offset 2"),
    ('x{job="a", namespace!~"p.*"}', "the matcher on 'namespace' at offset 11"),
    ("x[5m", "'[' at offset 1 is never closed"),
    ("sum(x", "'(' is never closed"),
    ("x}", "'}' at offset 1 closes nothing"),
    ("x $ y", "unexpected character '$' at offset 2"),
    ("x" * (MAX_QUERY + 1), f"more than {MAX_QUERY}"),
])
def test_what_cannot_be_scoped_is_refused_with_the_place(query: str, message: str) -> None:
    with pytest.raises(PromQLError, match=message.replace("[", r"\[").replace("(", r"\(").replace("$", r"\$")):
        scope(query, "llm", "prod")


def test_a_namespace_kubernetes_cannot_have_is_refused() -> None:
    with pytest.raises(ValueError, match="RFC 1123"):
        scope("up", "llm", 'prod|.*')


def test_admission_refuses_a_query_the_autoscaler_could_not_scope_with_its_field() -> None:
    p = plan(make_spec(autoscaling={"enabled": True, "query": 'sum(x{deployment="someone-else"})'}))
    assert [(e.field, e.message.split(":")[0]) for e in p.errors] == [
        ("spec.autoscaling.query", "the matcher on 'deployment' at offset 6")]
    assert not plan(make_spec(autoscaling={"enabled": True, "query": "sum(x)"})).errors
