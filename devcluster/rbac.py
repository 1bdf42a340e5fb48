"""What a user may do on the local API server: Kubernetes' RBAC authorizer over the stored Roles, ClusterRoles,
RoleBindings and ClusterRoleBindings (rbac.authorization.k8s.io/v1), and the request attributes it judges, read
from the method and path as the API server's request-info resolver reads them. Pure.

- Attributes: a path under `/api/v1/...` or `/apis/GROUP/VERSION/...` that names a resource is a resource request
  (its API group, resource, subresource, namespace and name; `/api/v1/namespaces/NAME` is in the namespace NAME, as
  in Kubernetes); its verb is get (a named GET), list (a collection's GET), watch (`watch=true|1` or the `/watch/`
  prefix), create (POST), update (PUT), patch (PATCH), delete (a named DELETE) or deletecollection. Any other path
  (`/api`, `/apis/GROUP`, `/healthz`, `/version`) is a non-resource request, its verb the method in lower case.
- Rules: `verbs`, `apiGroups`, `resources` (`pods/status` for a subresource, `*` and `*/scale` wildcards),
  `resourceNames` (a request without a name, such as list or create, matches no rule that names some) and
  `nonResourceURLs` (exact, or a prefix ending in `*`).
- Bindings: a ClusterRoleBinding grants its ClusterRole everywhere; a RoleBinding grants its Role, or a
  ClusterRole, in its own namespace only. Subjects: a User by name, a Group by name, a ServiceAccount by namespace
  (the binding's when left out) and name.
- Built in, as the API server bootstraps them but not stored: the `system:masters` group may do anything;
  `system:discovery` (every authenticated user may GET `/api`, `/apis` and below, `/healthz`, `/livez`, `/readyz`,
  `/version`, `/openapi`), `system:public-info-viewer` (the health and version paths, for the unauthenticated too)
  and `system:basic-user` (SelfSubjectAccessReviews, SelfSubjectRulesReviews and SelfSubjectReviews); the
  ClusterRoles `cluster-admin` and these three answer a binding that names them unless a stored one of that name
  exists. The aggregated roles (`admin`, `edit`, `view`) and `aggregationRule` are not emulated.
- Refusals: 403 with Kubernetes' message (`forbidden`), e.g. `pods is forbidden: User "system:serviceaccount:ns:sa"
  cannot list resource "pods" in API group "" in the namespace "ns"`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .auth import User
from .paths import parse_path

Obj = Mapping[str, Any]
MASTERS = "system:masters"

_DISCOVERY_URLS = ["/api", "/api/*", "/apis", "/apis/*", "/healthz", "/livez", "/openapi", "/openapi/*", "/readyz",
                   "/version", "/version/"]
_PUBLIC_URLS = ["/healthz", "/livez", "/readyz", "/version", "/version/"]
#: the bootstrap ClusterRoles a binding may name without storing them
BUILTIN_CLUSTER_ROLES: dict[str, list[dict[str, Any]]] = {
    "cluster-admin": [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
                      {"nonResourceURLs": ["*"], "verbs": ["*"]}],
    "system:discovery": [{"nonResourceURLs": _DISCOVERY_URLS, "verbs": ["get"]}],
    "system:public-info-viewer": [{"nonResourceURLs": _PUBLIC_URLS, "verbs": ["get"]}],
    "system:basic-user": [
        {"apiGroups": ["authorization.k8s.io"], "resources": ["selfsubjectaccessreviews", "selfsubjectrulesreviews"],
         "verbs": ["create"]},
        {"apiGroups": ["authentication.k8s.io"], "resources": ["selfsubjectreviews"], "verbs": ["create"]}],
}
#: the bootstrap ClusterRoleBindings: (ClusterRole, the groups it is bound to)
BUILTIN_BINDINGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("system:discovery", ("system:authenticated",)),
    ("system:public-info-viewer", ("system:authenticated", "system:unauthenticated")),
    ("system:basic-user", ("system:authenticated",)),
)


@dataclass(frozen=True)
class Attributes:
    """What a request asks to do, as the authorizer judges it (Kubernetes' authorizer.Attributes)."""

    user: User
    verb: str
    path: str
    resource_request: bool
    group: str = ""
    resource: str = ""
    subresource: str = ""
    namespace: str = ""
    name: str = ""


def attributes(user: User, method: str, path: str, params: Mapping[str, str]) -> Attributes:
    """The request's attributes, from its method, path and query."""
    parsed = parse_path(path)
    method = method.upper()
    if parsed.resource is None or parsed.resource.plural is None or parsed.resource.version is None:
        return Attributes(user, method.lower() if method != "HEAD" else "get", path, resource_request=False)
    named = parsed.name is not None
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, "get")
    if parsed.watch or (verb == "get" and not named and params.get("watch", "").lower() in ("true", "1")):
        verb = "watch"
    elif verb == "get" and not named:
        verb = "list"
    elif verb == "delete" and not named:
        verb = "deletecollection"
    plural = str(parsed.resource.plural)
    namespace = parsed.namespace or ""
    if plural == "namespaces" and named and not namespace:
        namespace = str(parsed.name)  # Kubernetes reads /api/v1/namespaces/NAME as being in the namespace NAME
    return Attributes(user, verb, path, resource_request=True, group=str(parsed.resource.group or ""),
                      resource=plural, subresource=parsed.subresource or "", namespace=namespace,
                      name=parsed.name or "")


@dataclass
class Policy:
    """The stored RBAC objects, indexed for lookups: built again whenever one of them changes."""

    cluster_roles: dict[str, list[Obj]] = field(default_factory=dict)
    roles: dict[tuple[str, str], list[Obj]] = field(default_factory=dict)
    cluster_bindings: list[Obj] = field(default_factory=list)
    role_bindings: dict[str, list[Obj]] = field(default_factory=dict)

    @classmethod
    def of(cls, *, roles: Iterable[Obj], cluster_roles: Iterable[Obj], role_bindings: Iterable[Obj],
           cluster_bindings: Iterable[Obj]) -> Policy:
        policy = cls(cluster_roles={name: list(rules) for name, rules in BUILTIN_CLUSTER_ROLES.items()})
        for role in cluster_roles:
            policy.cluster_roles[_meta(role)["name"]] = list(role.get("rules") or [])
        for role in roles:
            policy.roles[_meta(role).get("namespace") or "", _meta(role)["name"]] = list(role.get("rules") or [])
        policy.cluster_bindings = [{"roleRef": {"kind": "ClusterRole", "name": name},
                                    "subjects": [{"kind": "Group", "name": group} for group in groups]}
                                   for name, groups in BUILTIN_BINDINGS]
        policy.cluster_bindings += list(cluster_bindings)
        for binding in role_bindings:
            policy.role_bindings.setdefault(_meta(binding).get("namespace") or "", []).append(binding)
        return policy

    def rules(self, user: User, namespace: str) -> Iterator[Obj]:
        """The rules granted to the user: cluster-wide, and in `namespace` when the request is in one."""
        for binding in self.cluster_bindings:
            if _bound(binding, user, ""):
                yield from self._role_rules(binding.get("roleRef") or {}, "")
        for binding in self.role_bindings.get(namespace, []) if namespace else []:
            if _bound(binding, user, namespace):
                yield from self._role_rules(binding.get("roleRef") or {}, namespace)

    def _role_rules(self, ref: Obj, namespace: str) -> list[Obj]:
        if ref.get("kind") == "ClusterRole":
            return self.cluster_roles.get(str(ref.get("name")), [])
        if ref.get("kind") == "Role" and namespace:
            return self.roles.get((namespace, str(ref.get("name"))), [])
        return []

    def allows(self, attrs: Attributes) -> bool:
        if MASTERS in attrs.user.groups:
            return True
        return any(rule_allows(rule, attrs) for rule in self.rules(attrs.user, attrs.namespace))


def rule_allows(rule: Obj, attrs: Attributes) -> bool:
    verbs = rule.get("verbs") or []
    if "*" not in verbs and attrs.verb not in verbs:
        return False
    if not attrs.resource_request:
        return any(url == "*" or url == attrs.path or (url.endswith("*") and attrs.path.startswith(url[:-1]))
                   for url in rule.get("nonResourceURLs") or [])
    groups = rule.get("apiGroups") or []
    if "*" not in groups and attrs.group not in groups:
        return False
    combined = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    if not any(r == "*" or r == combined or (attrs.subresource and r == f"*/{attrs.subresource}")
               for r in rule.get("resources") or []):
        return False
    names = rule.get("resourceNames") or []
    return not names or attrs.name in names


def forbidden_message(attrs: Attributes) -> str:
    """Kubernetes' message for a refused request."""
    who = f"User {_quote(attrs.user.name)}"
    if not attrs.resource_request:
        return f"forbidden: {who} cannot {attrs.verb} path {_quote(attrs.path)}"
    resource = f"{attrs.resource}/{attrs.subresource}" if attrs.subresource else attrs.resource
    scope = f"in the namespace {_quote(attrs.namespace)}" if attrs.namespace else "at the cluster scope"
    reason = f"{who} cannot {attrs.verb} resource {_quote(resource)} in API group {_quote(attrs.group)} {scope}"
    qualified = f"{attrs.resource}.{attrs.group}" if attrs.group else attrs.resource
    return f"{qualified} {_quote(attrs.name)} is forbidden: {reason}" if attrs.name else \
        f"{qualified} is forbidden: {reason}"


def forbidden_details(attrs: Attributes) -> dict[str, Any]:
    """The Status details of a refusal: the group, the resource as `kind` and the name, where there are some."""
    details = {"name": attrs.name, "group": attrs.group, "kind": attrs.resource}
    return {key: value for key, value in details.items() if value}


def _bound(binding: Obj, user: User, namespace: str) -> bool:
    for subject in binding.get("subjects") or []:
        kind, name = subject.get("kind"), subject.get("name")
        if kind == "User" and name == user.name:
            return True
        if kind == "Group" and name in user.groups:
            return True
        if kind == "ServiceAccount":
            account_namespace = subject.get("namespace") or namespace
            if account_namespace and user.name == f"system:serviceaccount:{account_namespace}:{name}":
                return True
    return False


def _meta(obj: Obj) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def _quote(text: str) -> str:
    """Go's %q of a plain string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
