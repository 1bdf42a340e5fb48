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


def test_controllers_reach_agents_only_through_the_client() -> None:
    for path, names in imports_of("controllers").items():
        bad = {n for n in _hits(names, ("shardwise.agents",)) if not n.startswith("shardwise.agents.client")}
        assert not bad, f"{path} imports {bad}"


def test_every_top_level_part_is_mapped_into_the_shardwise_namespace() -> None:
    import importlib

    for folder, module in PARTS.items():
        mod = importlib.import_module(module)
        assert Path(mod.__file__ or "").resolve().parent == ROOT / folder
