"""The layer rules of docs/architecture.md, checked on the source: the core imports none of the other parts
nor kopf/kubernetes/grpc; agents never import the operator or the controllers; only the CLI and the tests
import devcluster."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = {"shardwise": "shardwise", "operator": "shardwise.operator", "controllers": "shardwise.controllers",
         "agents": "shardwise.agents", "devcluster": "shardwise.devcluster"}


def imports_of(folder: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / folder).rglob("*.py"):
        if "_pb2" in path.name:
            continue
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def _hits(names: set[str], forbidden: tuple[str, ...]) -> set[str]:
    return {n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden)}


CORE_FORBIDDEN = ("kopf", "kubernetes", "grpc", "shardwise.operator", "shardwise.controllers",
                  "shardwise.agents", "shardwise.devcluster")


@pytest.mark.parametrize("path,names", sorted(imports_of("shardwise").items()))
def test_the_core_imports_no_kopf_kubernetes_grpc_or_other_parts(path: str, names: set[str]) -> None:
    if path == "shardwise/cli.py":
        return  # the CLI is the one face that wires every part, lazily
    assert not _hits(names, CORE_FORBIDDEN), f"{path} imports {_hits(names, CORE_FORBIDDEN)}"


@pytest.mark.parametrize("path,names", sorted(imports_of("agents").items()))
def test_agents_never_import_the_operator_or_the_controllers(path: str, names: set[str]) -> None:
    bad = _hits(names, ("shardwise.operator", "shardwise.controllers", "shardwise.devcluster", "kopf"))
    assert not bad, f"{path} imports {bad}"


@pytest.mark.parametrize("folder", ["operator", "controllers", "agents"])
def test_nothing_but_the_cli_and_tests_imports_devcluster(folder: str) -> None:
    for path, names in imports_of(folder).items():
        assert not _hits(names, ("shardwise.devcluster",)), f"{path} imports devcluster"


def test_the_operator_reaches_agents_only_through_the_controllers() -> None:
    for path, names in imports_of("operator").items():
        assert not _hits(names, ("shardwise.agents",)), f"{path} imports {_hits(names, ('shardwise.agents',))}"


@pytest.mark.parametrize("module", ["machine", "phases", "plans"])
def test_the_operators_decisions_import_only_the_standard_library(module: str) -> None:
    """operator/machine.py, phases.py and plans.py are pure: no API client, no gRPC, no clock, nothing of the
    project (phases takes its vocabulary from machine, and nothing else)."""
    tree = ast.parse((ROOT / "operator" / f"{module}.py").read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) if n.module != "__future__"}
    relative = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level}
    assert relative <= ({"machine"} if module == "phases" else set()), relative
    assert names - relative <= {"collections.abc", "dataclasses"}, names


def test_controllers_reach_agents_only_through_the_client() -> None:
    for path, names in imports_of("controllers").items():
        bad = {n for n in _hits(names, ("shardwise.agents",)) if not n.startswith("shardwise.agents.client")}
        assert not bad, f"{path} imports {bad}"


def test_every_top_level_part_is_mapped_into_the_shardwise_namespace() -> None:
    import importlib

    for folder, module in PARTS.items():
        mod = importlib.import_module(module)
        assert Path(mod.__file__ or "").resolve().parent == ROOT / folder


def module_graph() -> dict[str, set[str]]:
    """Every module of every part -> the modules of the project it imports (relative imports resolved, imports
    inside functions and under TYPE_CHECKING included: a lazy import hides a cycle, it does not remove it)."""
    files: dict[str, Path] = {}
    for folder, package in PARTS.items():
        for path in (ROOT / folder).rglob("*.py"):
            if "_pb2" in path.name:
                continue
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            files[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            edges.update(t for t in targets if t in files and t != name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_two_modules_import_each_other_even_lazily() -> None:
    graph = module_graph()
    assert "shardwise.operator.elastic" in graph["shardwise.operator.reconcile"]  # the graph sees the imports
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle_through_a_lazy_import() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
