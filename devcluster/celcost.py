"""A guard against the CEL expressions a real API server refuses as over its cost budget, for the CRDs the local API
server is given. It is a conservative approximation, not Kubernetes' cost estimator.

Kubernetes estimates the worst-case cost of every rule and messageExpression of a CRD's `x-kubernetes-validations`
from the expression and the schema it applies to (the most items, properties and characters each list, map and
string may hold: `maxItems`, `maxProperties`, `maxLength`) and refuses the CRD when an estimate is over its budget:
`spec.validation.openAPIV3Schema.properties[spec].x-kubernetes-validations[0].messageExpression: Forbidden:
estimated messageExpression cost exceeds budget by factor of more than 100x (try simplifying the
messageExpression, or adding maxItems, maxProperties, and maxLength where arrays, maps, and strings are declared)`.
That estimator is not reproduced here. This guard refuses, with that message, the forms whose cost it cannot show
to be bounded:

- `string(X)` where X is not known to be a string (an integer, a bool, anything computed): the string it makes has
  no bound (the form of `'a=' + string(self.a)`, which a real server refuses);
- an iteration over a collection not known to be bounded: the macros `all`, `exists`, `exists_one`, `map` and
  `filter` and `join()` over anything but a list with `maxItems`, a map with `maxProperties` or a literal, and the
  `in` operator over a list that is not (`in` a map looks a key up);
- `size()` of a string, list or map not known to be bounded, and the string functions (`contains`, `startsWith`,
  `matches`, `split`...) on a string not known to be bounded (by `maxLength`, or an `enum`).

What is known is what the guard reads off the expression: `self` (and `oldSelf`) is the schema node the rule sits
on; `.field` and `[index]` follow `properties`, `items` and `additionalProperties` (field names with Kubernetes'
CEL escapes, `__dash__`...); a macro's variable is an element of its list (a key of its map: an unbounded string);
a literal bounds itself, and `+` adds bounds. Anything else (a function's result, a field of an untyped value) is
not known, and any form above applied to it is refused. So the forms the guard passes are the forms known to pass;
it refuses some that a real server accepts (it is stricter), and it does not look at costs outside these forms
(comparisons of long strings, a rule repeated for every item of an unbounded list). An expression that does not
parse is left to validation.py, which reports it on every write of the custom resource.

As in Kubernetes, an expression a CRD already held is not checked again when the CRD is updated.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from celpy.celparser import CELParser
from lark import Token, Tree

Shape = Mapping[str, Any] | None  # the schema of a value (None: not known)

MACROS = frozenset({"all", "exists", "exists_one", "map", "filter"})
STRING_FUNCTIONS = frozenset({"contains", "startsWith", "endsWith", "matches", "indexOf", "lastIndexOf",
                              "lowerAscii", "upperAscii", "replace", "split", "substring", "trim", "charAt",
                              "format", "find", "findAll"})
_BOOL: Mapping[str, Any] = {"type": "boolean"}
_NUMBER: Mapping[str, Any] = {"type": "number"}
_STRING: Mapping[str, Any] = {"type": "string"}  # with no bound
_ESCAPE = re.compile(r"__(underscores|dot|dash|slash)__")
_UNESCAPED = {"underscores": "__", "dot": ".", "dash": "-", "slash": "/"}
_RESERVED = frozenset({"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function",
                       "if", "import", "let", "loop", "package", "namespace", "return", "var", "void", "while"})


@dataclass(frozen=True)
class Refusal:
    path: str  # where Kubernetes names the expression: `...x-kubernetes-validations[0].rule`
    what: str  # "rule" or "messageExpression"
    reason: str  # the form the guard refused (not in the API's message: for the log)

    @property
    def message(self) -> str:
        return (f"{self.path}: Forbidden: estimated {self.what} cost exceeds budget by factor of more than 100x (try "
                f"simplifying the {self.what}, or adding maxItems, maxProperties, and maxLength where arrays, maps, "
                "and strings are declared)")


def refusals(crd: Mapping[str, Any], previous: Mapping[str, Any] | None = None) -> list[Refusal]:
    """The rules and messageExpressions of a CRD the guard refuses (none: it passes), except those `previous` (the
    CRD before an update) already held."""
    held = set(expressions(previous)) if previous is not None else set()
    found = []
    for path, node, rule in _rules(crd):
        for what in ("rule", "messageExpression"):
            text = rule.get(what)
            if isinstance(text, str) and text and text not in held:
                reason = over_budget(text, node)
                if reason is not None:
                    found.append(Refusal(f"{path}.{what}", what, reason))
    return found


def expressions(crd: Mapping[str, Any]) -> Iterator[str]:
    """Every rule and messageExpression of a CRD's schemas."""
    for _, _, rule in _rules(crd):
        for what in ("rule", "messageExpression"):
            if isinstance(rule.get(what), str):
                yield rule[what]


def _rules(crd: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any], Mapping[str, Any]]]:
    """Each validation rule of a CRD: its path, the schema node it sits on and the rule."""
    for base, schema in _schemas(crd):
        for path, node in _nodes(schema, base):
            for index, rule in enumerate(node.get("x-kubernetes-validations") or []):
                if isinstance(rule, Mapping):
                    yield f"{path}.x-kubernetes-validations[{index}]", node, rule


def _schemas(crd: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """The CRD's schemas and their paths: one `spec.validation.openAPIV3Schema` when every version has the same (as
    Kubernetes names it then), else each version's."""
    versions = [v for v in (crd.get("spec") or {}).get("versions") or [] if isinstance(v, Mapping)]
    schemas = [(v.get("schema") or {}).get("openAPIV3Schema") for v in versions]
    if schemas and isinstance(schemas[0], Mapping) and all(s == schemas[0] for s in schemas):
        return [("spec.validation.openAPIV3Schema", schemas[0])]
    return [(f"spec.versions[{i}].schema.openAPIV3Schema", s) for i, s in enumerate(schemas) if isinstance(s, Mapping)]


def _nodes(schema: Mapping[str, Any], path: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every node of a schema reached through properties, items and additionalProperties, with its path."""
    yield path, schema
    for name, child in (schema.get("properties") or {}).items():
        if isinstance(child, Mapping):
            yield from _nodes(child, f"{path}.properties[{name}]")
    for key in ("items", "additionalProperties"):
        child = schema.get(key)
        if isinstance(child, Mapping):
            yield from _nodes(child, f"{path}.{key}")


@functools.cache
def _parser() -> CELParser:
    return CELParser()


def over_budget(expression: str, schema: Mapping[str, Any]) -> str | None:
    """Why the guard refuses this expression on this schema node (None: it passes)."""
    try:
        tree = _parser().parse(expression)
    except Exception:  # celpy's parse errors have no common base; validation.py reports them
        return None
    guard = _Guard({"self": schema, "oldSelf": schema})
    guard.shape(tree)
    return guard.reasons[0] if guard.reasons else None


class _Guard:
    """Walks a parsed expression, inferring the shape of each value, and notes each form it refuses."""

    def __init__(self, scope: dict[str, Shape]) -> None:
        self.scope = scope
        self.reasons: list[str] = []

    def shape(self, node: Tree[Token] | Token | None) -> Shape:
        if not isinstance(node, Tree):
            return None
        handler = getattr(self, f"_{node.data}", None)
        if handler is not None:
            shape: Shape = handler([c for c in node.children if c is not None])
            return shape
        shapes = [self.shape(child) for child in node.children]
        return shapes[0] if len(shapes) == 1 else None  # (expr, member, primary... wrap one child)

    def refuse(self, why: str) -> None:
        self.reasons.append(why)

    # -- operators ------------------------------------------------------------------------------------------------

    def _expr(self, children: list[Any]) -> Shape:
        if len(children) == 3:  # a ? b : c
            self.shape(children[0])
            return _either(self.shape(children[1]), self.shape(children[2]))
        return self.shape(children[0])

    def _conditionalor(self, children: list[Any]) -> Shape:
        shapes = [self.shape(child) for child in children]
        return _BOOL if len(shapes) > 1 else shapes[0]

    _conditionaland = _conditionalor

    def _relation(self, children: list[Any]) -> Shape:
        if len(children) == 1:
            return self.shape(children[0])
        operator, right = children
        self.shape(operator.children[0])
        collection = self.shape(right)
        is_map = collection is not None and collection.get("type") == "object"  # a key lookup: no iteration
        if operator.data == "relation_in" and not is_map and not _bounded_collection(collection):
            self.refuse("`in` over a list not known to be bounded")
        return _BOOL

    def _addition(self, children: list[Any]) -> Shape:
        if len(children) == 1:
            return self.shape(children[0])
        operator, right = children
        left, shape = self.shape(operator.children[0]), self.shape(right)
        return _sum(left, shape) if operator.data == "addition_add" else _NUMBER

    def _multiplication(self, children: list[Any]) -> Shape:
        if len(children) == 1:
            return self.shape(children[0])
        self.shape(children[0].children[0])
        self.shape(children[1])
        return _NUMBER

    def _unary(self, children: list[Any]) -> Shape:
        if len(children) == 1:
            return self.shape(children[0])
        self.shape(children[1])
        return _BOOL if children[0].data == "unary_not" else _NUMBER

    def _paren_expr(self, children: list[Any]) -> Shape:
        return self.shape(children[0])

    # -- values -------------------------------------------------------------------------------------------------

    def _ident(self, children: list[Any]) -> Shape:
        return self.scope.get(str(children[0]))

    def _literal(self, children: list[Any]) -> Shape:
        token = children[0]
        if token.type in ("STRING_LIT", "MLSTRING_LIT", "BYTES_LIT"):
            return {"type": "string", "maxLength": len(token)}
        if token.type == "BOOL_LIT":
            return _BOOL
        return {"type": "null"} if token.type == "NULL_LIT" else _NUMBER

    def _list_lit(self, children: list[Any]) -> Shape:
        items = [self.shape(item) for item in _arguments(children)]
        element: Shape = items[0] if items else {}
        for item in items[1:]:
            element = _either(element, item)
        return {"type": "array", "maxItems": len(items), "items": element if element is not None else {}}

    def _map_lit(self, children: list[Any]) -> Shape:
        entries = [self.shape(entry) for entry in (children[0].children if children else [])]
        return {"type": "object", "maxProperties": len(entries) // 2}

    def _member_dot(self, children: list[Any]) -> Shape:
        return _field(self.shape(children[0]), str(children[1]))

    def _member_index(self, children: list[Any]) -> Shape:
        collection = self.shape(children[0])
        self.shape(children[1])
        return _element(collection)

    # -- calls ------------------------------------------------------------------------------------------------------

    def _member_dot_arg(self, children: list[Any]) -> Shape:
        receiver, name, arguments = children[0], str(children[1]), _arguments(children[2:])
        if name in MACROS:
            return self._macro(name, self.shape(receiver), arguments)
        return self._call(name, self.shape(receiver), [self.shape(a) for a in arguments])

    def _ident_arg(self, children: list[Any]) -> Shape:
        name, arguments = str(children[0]), _arguments(children[1:])
        if name == "has":  # a presence test: no value is read
            return _BOOL
        shapes = [self.shape(a) for a in arguments]
        return self._call(name, shapes[0] if shapes else None, shapes[1:])

    def _call(self, name: str, receiver: Shape, arguments: list[Shape]) -> Shape:
        """A function applied to `receiver` (a method's receiver, or a global function's first argument)."""
        if name == "string":
            if not _is_string(receiver):
                self.refuse("string() of a value not known to be a string")
                return _STRING
            return receiver
        if name in ("size", "join") or name in STRING_FUNCTIONS:
            if not _bounded(receiver):
                self.refuse(f"{name}() of a string, list or map not known to be bounded")
            if name in ("lowerAscii", "upperAscii", "trim"):
                return receiver
            if name in ("contains", "startsWith", "endsWith", "matches"):
                return _BOOL
            return _NUMBER if name in ("size", "indexOf", "lastIndexOf") else None
        return {"int": _NUMBER, "uint": _NUMBER, "double": _NUMBER, "bool": _BOOL}.get(name)

    def _macro(self, name: str, collection: Shape, arguments: list[Any]) -> Shape:
        if not _bounded_collection(collection):
            self.refuse(f"{name}() over a list or map not known to be bounded")
        variable = _identifier(arguments[0]) if arguments else None
        if variable is None:  # not a macro's form: an ordinary call
            return self._call(name, collection, [self.shape(a) for a in arguments])
        element = _STRING if collection is not None and collection.get("type") == "object" else _element(collection)
        outer = self.scope
        self.scope = {**outer, variable: element}
        try:
            shapes = [self.shape(a) for a in arguments[1:]]
        finally:
            self.scope = outer
        if name == "filter":
            return collection
        if name == "map" and collection is not None:
            bound = collection.get("maxItems", collection.get("maxProperties"))
            mapped = {"type": "array", "items": shapes[-1] or {}}
            return mapped if bound is None else {**mapped, "maxItems": bound}
        return _BOOL


def _arguments(children: list[Any]) -> list[Any]:
    """The expressions of an optional exprlist."""
    return [child for tree in children if isinstance(tree, Tree) for child in tree.children]


def _identifier(node: Any) -> str | None:
    """The name, when the expression is a bare identifier (a macro's variable)."""
    while isinstance(node, Tree) and node.data != "ident" and len(node.children) == 1:
        node = node.children[0]
    return str(node.children[0]) if isinstance(node, Tree) and node.data == "ident" else None


def _unescape(name: str) -> str:
    """A property's name from its CEL spelling (`foo__dash__bar` is `foo-bar`, `__if__` is `if`)."""
    if name.startswith("__") and name.endswith("__") and name[2:-2] in _RESERVED:
        return name[2:-2]
    return _ESCAPE.sub(lambda match: _UNESCAPED[match.group(1)], name)


def _field(shape: Shape, name: str) -> Shape:
    if shape is None:
        return None
    properties = shape.get("properties") or {}
    for key in (name, _unescape(name)):
        if isinstance(properties.get(key), Mapping):
            return properties[key]  # type: ignore[no-any-return]
    values = shape.get("additionalProperties")
    return values if isinstance(values, Mapping) else None


def _element(shape: Shape) -> Shape:
    """An item of a list, or a value of a map."""
    if shape is None:
        return None
    inner = shape.get("items") if shape.get("type") == "array" else shape.get("additionalProperties")
    return inner if isinstance(inner, Mapping) else None


def _is_string(shape: Shape) -> bool:
    return shape is not None and shape.get("type") == "string"


def _max_length(shape: Shape) -> int | None:
    """The most characters a string may hold (None: no bound)."""
    if shape is None or shape.get("type") != "string":
        return None
    if isinstance(shape.get("maxLength"), int):
        return int(shape["maxLength"])
    enum = shape.get("enum")
    return max((len(str(value)) for value in enum), default=0) if isinstance(enum, list) else None


def _bounded(shape: Shape) -> bool:
    """A string with a bound, or a list or map with one."""
    return _max_length(shape) is not None or _bounded_collection(shape)


def _bounded_collection(shape: Shape) -> bool:
    if shape is None:
        return False
    kind = shape.get("type")
    return (kind == "array" and "maxItems" in shape) or (kind == "object" and "maxProperties" in shape)


def _sum(left: Shape, right: Shape) -> Shape:
    """The shape of `left + right`: strings and lists add their bounds; numbers stay numbers."""
    if left is None or right is None:
        return None
    if _is_string(left) and _is_string(right):
        a, b = _max_length(left), _max_length(right)
        return _STRING if a is None or b is None else {"type": "string", "maxLength": a + b}
    if left.get("type") == right.get("type") == "array":
        items = _either(left.get("items") or {}, right.get("items") or {}) or {}
        if "maxItems" in left and "maxItems" in right:
            return {"type": "array", "items": items, "maxItems": left["maxItems"] + right["maxItems"]}
        return {"type": "array", "items": items}
    return _NUMBER


def _either(a: Shape, b: Shape) -> Shape:
    """A value that is `a` or `b`: the looser of the two when they are of one type, else not known."""
    if a is None or b is None or a.get("type") != b.get("type"):
        return None
    if _is_string(a):
        la, lb = _max_length(a), _max_length(b)
        return _STRING if la is None or lb is None else {"type": "string", "maxLength": max(la, lb)}
    if a.get("type") == "array" and a.get("maxItems") != b.get("maxItems"):
        looser = dict(a)
        if "maxItems" in a and "maxItems" in b:
            looser["maxItems"] = max(a["maxItems"], b["maxItems"])
        else:
            looser.pop("maxItems", None)
        return looser
    return a
