"""The RBAC grants the operator needs, read from its code (not from a list kept by hand).

Every call on the operator's API client (`kube.get/list/create/patch/delete/request`) in `operator/` and
`controllers/` is found in the syntax tree, and the kinds it can touch are resolved: a literal or a module constant
(`"Pod"`, `KIND`), an object's `["kind"]` where the object comes from a builder in `operator/builders.py` (whose
returned objects name their kinds literally), directly, through a variable, a tuple assignment, a list it was
appended to or a loop over one. A call whose kind cannot be resolved is an error, so new code stays readable here.
kopf's own calls are added from the resources its decorators name, with what kopf does with them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from shardwise.api import GROUP, PLURAL, VERSION

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted([*ROOT.glob("operator/*.py"), *ROOT.glob("controllers/*.py")])
CLIENT_VERBS = {"get": "get", "list": "list", "create": "create", "patch": "patch", "delete": "delete",
                "list_all": "list", "watch": "watch"}
HTTP_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}

Grant = tuple[str, str, str]  # (API group, resource[/subresource], verb)


@dataclass(frozen=True)
class Call:
    where: str  # file:line
    verb: str
    kinds: frozenset[str]
    subresource: str = ""


class Unresolved(Exception):
    pass


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _constants(tree: ast.Module) -> dict[str, str]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def _cached_kinds(tree: ast.Module) -> frozenset[str]:
    """The keys of a module-level `CACHED = {KIND: selector, ...}` (operator/cache.py): the kinds its informers
    (`self.kind`) list and watch."""
    for node in tree.body:
        if isinstance(node, ast.AnnAssign | ast.Assign) and isinstance(node.value, ast.Dict):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == "CACHED" for t in targets):
                return frozenset(k.value for k in node.value.keys if isinstance(k, ast.Constant))
    return frozenset()


def builder_kinds() -> dict[str, frozenset[str]]:
    """Each builder's name -> the kinds of the objects it returns (dict literals with apiVersion, kind, metadata)."""
    tree = ast.parse((ROOT / "operator/builders.py").read_text())
    out = {}
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef):
            kinds = {v.value for node in ast.walk(fn) if isinstance(node, ast.Dict)
                     for k, v in zip(node.keys, node.values, strict=True)
                     if isinstance(k, ast.Constant) and k.value == "kind" and isinstance(v, ast.Constant)
                     and {"apiVersion", "metadata"} <= {x.value for x in node.keys if isinstance(x, ast.Constant)}}
            if kinds:
                out[fn.name] = frozenset(kinds)
    return out


class _Resolver:
    def __init__(self, tree: ast.Module, builders: dict[str, frozenset[str]]) -> None:
        self.constants, self.builders, self.parents = _constants(tree), builders, _parents(tree)
        self.cached = _cached_kinds(tree)

    def _function(self, node: ast.AST) -> ast.AST:
        while node in self.parents and not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            node = self.parents[node]
        return node

    def _bindings(self, name: str, scope: ast.AST) -> Iterator[ast.expr]:
        """Every expression `name` is given in `scope`: assigned (also pairwise from a tuple), looped over (each
        element of the sequence) or appended to it."""
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id == name:
                        yield node.value
                    elif isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        yield from (v for t, v in zip(target.elts, node.value.elts, strict=True)
                                    if isinstance(t, ast.Name) and t.id == name)
            elif isinstance(node, ast.For) and isinstance(node.target, ast.Name) and node.target.id == name:
                yield from self._elements(node.iter, scope)

    def _elements(self, seq: ast.expr, scope: ast.AST) -> Iterator[ast.expr]:
        if isinstance(seq, ast.List | ast.Tuple):
            yield from seq.elts
        elif isinstance(seq, ast.Name):
            for value in self._bindings(seq.id, scope):
                yield from self._elements(value, scope)
            for node in ast.walk(scope):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == seq.id):
                    yield from node.args
        else:
            raise Unresolved(ast.unparse(seq))

    def kind(self, expr: ast.expr, scope: ast.AST) -> frozenset[str]:
        """The kinds a kind argument can name."""
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            return frozenset({expr.value})
        if isinstance(expr, ast.Name) and expr.id in self.constants:
            return frozenset({self.constants[expr.id]})
        if isinstance(expr, ast.Name):
            values = list(self._bindings(expr.id, scope))
            if values:
                return frozenset().union(*(self.kind(v, scope) for v in values))
        if (isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant) and expr.slice.value == "kind"):
            return self.obj(expr.value, scope)
        if ast.unparse(expr) == "self.kind" and self.cached:  # an informer of operator/cache.py
            return self.cached
        raise Unresolved(ast.unparse(expr))

    def obj(self, expr: ast.expr, scope: ast.AST) -> frozenset[str]:
        """The kinds of an object argument (a builder's result, directly or through variables)."""
        if isinstance(expr, ast.Call):
            func = expr.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in self.builders:
                return self.builders[name]
        if isinstance(expr, ast.Name):
            values = list(self._bindings(expr.id, scope))
            if values:
                return frozenset().union(*(self.obj(v, scope) for v in values))
        raise Unresolved(ast.unparse(expr))

    def url(self, expr: ast.expr, scope: ast.AST) -> tuple[frozenset[str], bool] | None:
        """A request's path: (kinds, names one object); None for a discovery path (no resource)."""
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "path":
            return self.kind(expr.args[0], scope), len(expr.args) >= 3
        text = ast.unparse(expr)
        if text.startswith("'/apis/' +"):
            return None
        raise Unresolved(text)


def _is_client(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id == "kube") or (isinstance(node, ast.Attribute)
                                                                  and node.attr == "kube")


def calls() -> list[Call]:
    """Every API call the operator's code makes, with the kinds it can touch."""
    builders, out = builder_kinds(), []
    for source in SOURCES:
        tree = ast.parse(source.read_text())
        resolve = _Resolver(tree, builders)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and _is_client(node.func.value)):
                continue
            method, where = node.func.attr, f"{source.relative_to(ROOT)}:{node.lineno}"
            scope = resolve._function(node)
            try:
                if method == "request":
                    assert isinstance(node.args[0], ast.Constant), where
                    target = resolve.url(node.args[1], scope)
                    if target is None:
                        continue
                    verb = HTTP_VERBS[node.args[0].value]
                    if verb == "get" and not target[1]:
                        verb = "list"
                    out.append(Call(where, verb, target[0]))
                elif method == "create":
                    out.append(Call(where, "create", resolve.obj(node.args[0], scope)))
                elif method in CLIENT_VERBS:
                    sub = next((k.value.value for k in node.keywords if k.arg == "subresource"
                                and isinstance(k.value, ast.Constant)), "")
                    out.append(Call(where, CLIENT_VERBS[method], resolve.kind(node.args[0], scope), sub))
            except Unresolved as e:
                raise AssertionError(f"{where}: cannot tell which kind `{e}` names") from e
    return out


def kopf_resources() -> list[tuple[str, str, bool]]:
    """(group, plural, is a daemon's) of every resource a kopf decorator in operator/ names."""
    out = []
    for source in sorted(ROOT.glob("operator/*.py")):
        tree = ast.parse(source.read_text())
        constants = {**_constants(tree), "GROUP": GROUP, "VERSION": VERSION, "PLURAL": PLURAL}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("kopf.daemon", "kopf.on.event",
                                                                        "kopf.timer"):
                args = [a.value if isinstance(a, ast.Constant) else constants[a.id] for a in node.args[:3]
                        if isinstance(a, ast.Constant | ast.Name)]
                out.append((args[0], args[2], ast.unparse(node.func) != "kopf.on.event"))
    return out


def operator_grants(resources: dict[str, tuple[str, str]]) -> set[Grant]:
    """What the operator's code and kopf need, as (group, resource, verb); `resources` maps a kind to its
    (group, plural), as the operator's client does."""
    grants: set[Grant] = set()
    for call in calls():
        for kind in call.kinds:
            group, plural = resources[kind]
            grants.add((group, plural + (f"/{call.subresource}" if call.subresource else ""), call.verb))
    for group, plural, daemon in kopf_resources():
        grants |= {(group, plural, "list"), (group, plural, "watch")}  # kopf's watch of each handled resource
        if daemon:
            grants.add((group, plural, "patch"))  # the finalizer kopf puts on an object its daemons serve
    grants.add(("", "events", "create"))  # kopf posts an event for every handler failure (core events only)
    return grants


# kopf's cluster-wide observers: the namespaces that exist and the custom resource definitions (it re-scans the
# API when one appears); both only listed and watched.
KOPF_CLUSTER_GRANTS: set[Grant] = {("", "namespaces", "list"), ("", "namespaces", "watch"),
                                   ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
                                   ("apiextensions.k8s.io", "customresourcedefinitions", "watch")}
