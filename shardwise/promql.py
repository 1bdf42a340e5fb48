"""PromQL selectors scoped to one deployment: `scope(query, deployment, namespace)` adds the deployment's own
matchers to every vector selector of a user's query, so that `spec.autoscaling.query` reads only its deployment's
series, never another tenant's.

Glossary. **vector selector**: a metric name, a `{...}` list of label matchers, or both (`up`, `{job="x"}`,
`http_requests_total{code="500"}`); the only place a query names series. **label list**: the parentheses after
`by`, `without`, `on`, `ignoring`, `group_left` and `group_right`, which name labels, not series.

The query is lexed (strings with their escapes, numbers, durations, identifiers, operators, comments), not
evaluated: an identifier followed by `(` is a function or an aggregation (so is an aggregation followed by `by`
or `without`), a keyword is an operator or a modifier, and any other identifier is a metric name; a range or a
subquery's `[...]` holds no selector. Each selector gets the matchers `deployment="<name>"` and, with a
namespace, `namespace=~"<namespace>|"` (the series of that namespace, or series without a namespace label, as
the default query matches). A user matcher on `deployment` or `namespace` is refused: the scope is not the user's
to widen, and one written to match the deployment itself is redundant. Worked example, deployment `llm` in `prod`:

    sum(rate(shardwise_generated_tokens_total[1m])) / on() group_left count(up{job="w"})
 -> sum(rate(shardwise_generated_tokens_total{deployment="llm",namespace=~"prod|"}[1m])) / on() group_left
    count(up{deployment="llm",namespace=~"prod|",job="w"})
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from shardwise.api import RFC1123_LABEL

#: labels the scope sets; a user's query may not match on them
SCOPE_LABELS = ("deployment", "namespace")
#: the longest query accepted (Prometheus itself takes far longer ones; a load query is a line or two)
MAX_QUERY = 4096


_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = _GROUPING | {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"}
#: aggregations, which may take their label list before the parentheses (`sum by (le) (x)`)
_AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                 "quantile", "limitk", "limit_ratio"}
_TOKEN = re.compile(r"""
    (?P<space>\s+|\#[^\n]*)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|`[^`]*`)
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+(?![a-zA-Z0-9_]))
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<op>==|!=|=~|!~|<=|>=|[-+*/%^<>=,(){}\[\]@])
""", re.VERBOSE)


class PromQLError(ValueError):
    """The query cannot be scoped: a character PromQL has no token for, unbalanced brackets, or a matcher on a
    scope label. The message names the offset in the query."""


@dataclass(frozen=True)
class Token:
    kind: str  # string, duration, number, ident, op
    text: str
    start: int
    end: int


def tokens(query: str) -> list[Token]:
    """The query's tokens without spaces and comments (PromQLError on a character no token starts with)."""
    if len(query) > MAX_QUERY:
        raise PromQLError(f"the query is {len(query)} characters, more than {MAX_QUERY}")
    out: list[Token] = []
    at = 0
    while at < len(query):
        m = _TOKEN.match(query, at)
        if m is None:
            raise PromQLError(f"unexpected character {query[at]!r} at offset {at}")
        kind = m.lastgroup
        assert kind is not None
        if kind != "space":
            out.append(Token(kind, m.group(), m.start(), m.end()))
        at = m.end()
    return out


def _close(toks: list[Token], i: int, opening: str, closing: str) -> int:
    """The index of the bracket closing the one at `i`."""
    depth = 0
    for j in range(i, len(toks)):
        if toks[j].kind == "op" and toks[j].text == opening:
            depth += 1
        elif toks[j].kind == "op" and toks[j].text == closing:
            depth -= 1
            if depth == 0:
                return j
    raise PromQLError(f"the {opening!r} at offset {toks[i].start} is never closed")


def _check_matchers(toks: list[Token], open_i: int, close_i: int) -> None:
    for j in range(open_i + 1, close_i):
        t = toks[j]
        is_label = t.kind in ("ident", "string") and j + 1 < close_i and toks[j + 1].kind == "op" \
            and toks[j + 1].text in ("=", "!=", "=~", "!~")
        name = t.text.strip("\"'`")
        if is_label and name in SCOPE_LABELS:
            raise PromQLError(f"the matcher on {name!r} at offset {t.start}: the autoscaler scopes every selector "
                              f"to the deployment's own series itself ({', '.join(SCOPE_LABELS)})")


def selectors(query: str) -> list[tuple[int, bool]]:
    """Where each vector selector takes the scope: (offset, inside braces). Inside braces the offset is just after
    the `{`; otherwise it is just after the metric name, where a `{...}` goes."""
    toks = tokens(query)
    found: list[tuple[int, bool]] = []
    i = 0
    while i < len(toks):
        t = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else None
        if t.kind == "ident" and t.text.lower() in _GROUPING and nxt is not None and nxt.text == "(":
            i = _close(toks, i + 1, "(", ")") + 1  # a label list
            continue
        called = nxt is not None and (nxt.text == "(" or (
            t.text.lower() in _AGGREGATIONS and nxt.kind == "ident" and nxt.text.lower() in ("by", "without")))
        if t.kind == "ident" and t.text.lower() not in _KEYWORDS and not called:
            if nxt is not None and nxt.text == "{":
                end = _close(toks, i + 1, "{", "}")
                _check_matchers(toks, i + 1, end)
                found.append((nxt.end, True))
                i = end + 1
            else:
                found.append((t.end, False))
                i += 1
            continue
        if t.kind == "op" and t.text == "{":
            end = _close(toks, i, "{", "}")
            _check_matchers(toks, i, end)
            found.append((t.end, True))
            i = end + 1
            continue
        if t.kind == "op" and t.text == "[":
            i = _close(toks, i, "[", "]") + 1  # a range or a subquery's durations: no selector inside
            continue
        if t.kind == "op" and t.text == "}":
            raise PromQLError(f"the '}}' at offset {t.start} closes nothing")
        i += 1
    for opening, closing in ("()", "[]"):
        depth = 0
        for t in toks:
            if t.kind == "op" and t.text in (opening, closing):
                depth += 1 if t.text == opening else -1
                if depth < 0:
                    raise PromQLError(f"the {closing!r} at offset {t.start} closes nothing")
        if depth:
            raise PromQLError(f"a {opening!r} is never closed")
    return found


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def matchers(deployment: str, namespace: str) -> str:
    """The scope's matchers, as they go inside braces."""
    if namespace and not RFC1123_LABEL.match(namespace):
        raise ValueError(f"namespace {namespace!r} is not a Kubernetes namespace name (RFC 1123 label)")
    scope = f"deployment={_quote(deployment)}"
    return scope + (f",namespace=~{_quote(namespace + '|')}" if namespace else "")  # no regex character in it


def scope(query: str, deployment: str, namespace: str) -> str:
    """`query` with every vector selector limited to the series of `deployment` in `namespace`."""
    if not deployment:
        raise ValueError("scope needs a deployment name")
    inner = matchers(deployment, namespace)
    out, last = [], 0
    for at, braces in selectors(query):
        out.append(query[last:at])
        if braces:
            rest = query[at:].lstrip()
            out.append(inner if rest.startswith("}") else inner + ",")
        else:
            out.append("{" + inner + "}")
        last = at
    out.append(query[last:])
    return "".join(out)
