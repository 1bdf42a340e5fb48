"""Identity on the local API server, as strict as a real one: bearer tokens checked exactly (401 otherwise),
ServiceAccount tokens from the TokenRequest API that die with their ServiceAccount, their bound pod or their
expiry, and RBAC from the stored Roles and bindings (403 with Kubernetes' messages). The plain-HTTP port's one
leniency, a request without credentials served as the admin, is checked too."""

from __future__ import annotations

import datetime
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.devcluster.apiclient import MERGE, Client

pytest.importorskip("kmock")
pytest.importorskip("cryptography")

from shardwise.devcluster import rbac
from shardwise.devcluster.apiserver import APIServer
from shardwise.devcluster.auth import ADMIN, User, service_account_user

UNAUTHORIZED = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": "Unauthorized",
                "reason": "Unauthorized", "code": 401}
ACCOUNTS = "/api/v1/namespaces/default/serviceaccounts"
PODS = "/api/v1/namespaces/default/pods"
RBAC = "/apis/rbac.authorization.k8s.io/v1"
IDEPS = "/apis/shardwise.io/v1alpha1/namespaces/default/inferencedeployments"


class Clock:
    """The server's clock, moved on by the test (tokens expire by it)."""

    def __init__(self) -> None:
        self.offset = datetime.timedelta()

    def __call__(self) -> datetime.datetime:
        return datetime.datetime.now(datetime.UTC) + self.offset


class Cluster:
    """A server, its admin (plain HTTP, no credentials) and helpers to make ServiceAccounts, tokens and grants."""

    def __init__(self, server: APIServer, clock: Clock) -> None:
        self.server, self.clock = server, clock
        self.admin = Client(server.url)

    def as_token(self, token: str | None = None, *, authorization: str | None = None) -> Client:
        """A client of the HTTPS port, trusting the server's CA, sending these credentials (none: anonymous)."""
        return Client(self.server.secure_url, token=token, authorization=authorization,
                      ca_pem=self.server.credentials.ca_pem)

    def account(self, name: str, namespace: str = "default") -> dict[str, Any]:
        created: dict[str, Any] = self.admin.create(f"/api/v1/namespaces/{namespace}/serviceaccounts", {
            "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}})
        return created

    def token(self, name: str, namespace: str = "default", **spec: Any) -> str:
        answer = self.admin.create(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                                   {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec})
        return str(answer["status"]["token"])

    def grant(self, name: str, rules: list[dict[str, Any]], *, namespace: str | None = "default",
              account: str = "reader", account_namespace: str = "default", cluster_role: bool = False) -> None:
        """Bind `rules` to a ServiceAccount: a Role and RoleBinding in `namespace`, or with `namespace=None` a
        ClusterRole and ClusterRoleBinding; `cluster_role` binds a ClusterRole with a RoleBinding."""
        subject = {"kind": "ServiceAccount", "name": account, "namespace": account_namespace}
        role_kind = "ClusterRole" if namespace is None or cluster_role else "Role"
        role_path = f"{RBAC}/clusterroles" if role_kind == "ClusterRole" else f"{RBAC}/namespaces/{namespace}/roles"
        self.admin.create(role_path, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": role_kind,
                                      "metadata": {"name": name}, "rules": rules})
        binding_kind = "ClusterRoleBinding" if namespace is None else "RoleBinding"
        binding_path = f"{RBAC}/clusterrolebindings" if namespace is None else \
            f"{RBAC}/namespaces/{namespace}/rolebindings"
        self.admin.create(binding_path, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": binding_kind,
                                         "metadata": {"name": name}, "subjects": [subject],
                                         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind,
                                                     "name": name}})


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    clock = Clock()
    with APIServer(clock=clock, min_token_seconds=600) as server:
        yield Cluster(server, clock)


def code_of(client: Client, path: str) -> int:
    """The status of a GET whose answer may not be JSON (`/healthz` answers `ok`)."""
    request = urllib.request.Request(client.url + path, headers=client.headers)
    try:
        with urllib.request.urlopen(request, timeout=5, context=client.context) as response:
            return int(response.status)
    except urllib.error.HTTPError as e:
        return e.code


def forbidden(account: str, verb: str, resource: str, *, namespace: str = "default", group: str = "",
              name: str = "") -> str:
    qualified = f"{resource.split('/')[0]}.{group}" if group else resource.split("/")[0]
    scope = f'in the namespace "{namespace}"' if namespace else "at the cluster scope"
    return (f'{qualified}{f" {chr(34)}{name}{chr(34)}" if name else ""} is forbidden: User "system:serviceaccount:'
            f'default:{account}" cannot {verb} resource "{resource}" in API group "{group}" {scope}')


# -- the required trio: another ServiceAccount's token, a malformed header, a missing grant ----------------------


def test_another_accounts_token_a_malformed_header_and_a_missing_grant_are_refused_with_kubernetes_messages(
        cluster: Cluster) -> None:
    cluster.account("reader")
    cluster.account("other")
    cluster.grant("pod-reader", [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]}])
    reader, other = cluster.token("reader"), cluster.token("other")
    assert cluster.as_token(reader).call("GET", PODS)[0] == 200
    # the token of another ServiceAccount, which has no grant: 403 naming that account
    assert cluster.as_token(other).call("GET", PODS) == (403, {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Forbidden", "code": 403,
        "message": forbidden("other", "list", "pods"), "details": {"kind": "pods"}})
    # the in-cluster client's lower-case scheme, sent twice: the token read is `bearer`, which no one holds
    assert cluster.as_token(authorization=f"Bearer bearer {reader}").call("GET", PODS) == (401, UNAUTHORIZED)
    # a grant the role lacks: list yes, delete no (and watch is a verb of its own)
    status, answer = cluster.as_token(reader).call("DELETE", f"{PODS}/web")
    assert (status, answer["message"]) == (403, forbidden("reader", "delete", "pods", name="web"))
    status, answer = cluster.as_token(reader).call("GET", PODS, watch="true")
    assert (status, answer["message"]) == (403, forbidden("reader", "watch", "pods"))
    # and in another namespace, and at the cluster scope
    status, answer = cluster.as_token(reader).call("GET", "/api/v1/namespaces/kube-system/pods")
    assert (status, answer["message"]) == (403, forbidden("reader", "list", "pods", namespace="kube-system"))
    status, answer = cluster.as_token(reader).call("GET", "/api/v1/nodes")
    assert (status, answer["message"]) == (403, forbidden("reader", "list", "nodes", namespace=""))


@pytest.mark.parametrize("header", [
    "Bearer bearer {token}", "Basic cmVhZGVyOnNlY3JldA==", "Bearer", "Bearer ", "Bearer wrong-token",
    "Token {token}", "Bearer {token}x",
], ids=["bearer twice", "basic", "no token", "empty token", "unknown token", "other scheme", "altered token"])
def test_credentials_that_are_not_a_known_bearer_token_are_401_on_both_ports(cluster: Cluster, header: str) -> None:
    cluster.account("reader")
    token = cluster.token("reader")
    for url in (cluster.server.url, cluster.server.secure_url):
        client = Client(url, authorization=header.format(token=token), ca_pem=cluster.server.credentials.ca_pem)
        assert client.call("GET", "/api/v1/namespaces") == (401, UNAUTHORIZED), url


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_scheme_is_read_in_any_case_and_the_admin_token_may_do_anything(cluster: Cluster, scheme: str) -> None:
    admin = cluster.as_token(authorization=f"{scheme} {cluster.server.credentials.admin_token}")
    assert admin.call("GET", "/api/v1/nodes")[0] == 200
    assert admin.call("POST", "/api/v1/namespaces", {"metadata": {"name": f"made-{scheme.lower()}"}})[0] == 201


def test_a_token_of_another_server_is_401(cluster: Cluster) -> None:
    with APIServer() as elsewhere:
        Client(elsewhere.url).create(ACCOUNTS, {"metadata": {"name": "reader"}})
        foreign = Client(elsewhere.url).create(f"{ACCOUNTS}/reader/token", {"spec": {}})["status"]["token"]
        assert Client(elsewhere.secure_url, token=foreign, ca_pem=elsewhere.credentials.ca_pem).call(
            "GET", "/api")[0] == 200
    cluster.account("reader")  # the same namespace and name here: the signature still tells them apart
    assert cluster.as_token(foreign).call("GET", "/api") == (401, UNAUTHORIZED)
    assert cluster.as_token(elsewhere.credentials.admin_token).call("GET", "/api") == (401, UNAUTHORIZED)


# -- the leniency and the anonymous ---------------------------------------------------------------------------------


def test_without_credentials_the_plain_http_port_serves_the_admin_and_the_tls_port_an_anonymous_user(
        cluster: Cluster) -> None:
    assert cluster.admin.call("GET", "/api/v1/nodes")[0] == 200
    anonymous = cluster.as_token()
    assert code_of(anonymous, "/healthz") == 200 and anonymous.call("GET", "/version")[0] == 200
    assert anonymous.call("GET", "/api") == (403, {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Forbidden",
        "code": 403, "message": 'forbidden: User "system:anonymous" cannot get path "/api"', "details": {}})
    status, answer = anonymous.call("GET", "/api/v1/nodes")
    assert (status, answer["message"]) == (403, 'nodes is forbidden: User "system:anonymous" cannot list resource '
                                                '"nodes" in API group "" at the cluster scope')


def test_every_authenticated_user_may_read_discovery_and_the_health_and_version_paths(cluster: Cluster) -> None:
    cluster.account("reader")
    reader = cluster.as_token(cluster.token("reader"))
    for path in ("/api", "/api/v1", "/apis", "/apis/apps", "/apis/apps/v1", "/version", "/healthz", "/readyz"):
        assert code_of(reader, path) == 200, path
    status, answer = reader.call("GET", "/metrics")
    assert (status, answer["message"]) == (
        403, 'forbidden: User "system:serviceaccount:default:reader" cannot get path "/metrics"')


# -- ServiceAccount tokens --------------------------------------------------------------------------------------------


def test_every_namespace_has_a_default_account_made_again_when_deleted(cluster: Cluster) -> None:
    assert "default" in cluster.admin.names(ACCOUNTS)
    cluster.admin.create("/api/v1/namespaces", {"metadata": {"name": "team-a"}})
    made = cluster.admin.get("/api/v1/namespaces/team-a/serviceaccounts/default")
    cluster.admin.ok("DELETE", "/api/v1/namespaces/team-a/serviceaccounts/default")
    again = cluster.admin.get("/api/v1/namespaces/team-a/serviceaccounts/default")
    assert again["metadata"]["uid"] != made["metadata"]["uid"]


def test_a_token_request_answers_a_token_and_its_expiry_with_the_apis_audience(cluster: Cluster) -> None:
    cluster.account("reader")
    answer = cluster.admin.create(f"{ACCOUNTS}/reader/token", {"apiVersion": "authentication.k8s.io/v1",
                                                               "kind": "TokenRequest",
                                                               "spec": {"expirationSeconds": 1200}})
    assert answer["kind"] == "TokenRequest" and answer["apiVersion"] == "authentication.k8s.io/v1"
    assert answer["spec"] == {"expirationSeconds": 1200, "audiences": ["https://kubernetes.default.svc.cluster.local"]}
    expires = datetime.datetime.fromisoformat(answer["status"]["expirationTimestamp"].replace("Z", "+00:00"))
    assert abs((expires - cluster.clock()).total_seconds() - 1200) < 5
    assert cluster.admin.call("POST", f"{ACCOUNTS}/nobody/token", {"spec": {}})[0] == 404


def test_a_token_of_a_deleted_account_is_refused_even_when_one_of_that_name_is_made_again(cluster: Cluster) -> None:
    cluster.account("reader")
    token = cluster.token("reader")
    assert cluster.as_token(token).call("GET", "/api")[0] == 200
    cluster.admin.ok("DELETE", f"{ACCOUNTS}/reader")
    assert cluster.as_token(token).call("GET", "/api") == (401, UNAUTHORIZED)
    cluster.account("reader")
    assert cluster.as_token(token).call("GET", "/api") == (401, UNAUTHORIZED)
    assert cluster.as_token(cluster.token("reader")).call("GET", "/api")[0] == 200


def test_an_expired_token_is_refused(cluster: Cluster) -> None:
    cluster.account("reader")
    token = cluster.token("reader", expirationSeconds=600)
    cluster.clock.offset = datetime.timedelta(seconds=590)
    assert cluster.as_token(token).call("GET", "/api")[0] == 200
    cluster.clock.offset = datetime.timedelta(seconds=601)
    assert cluster.as_token(token).call("GET", "/api") == (401, UNAUTHORIZED)


def test_a_token_bound_to_a_pod_dies_with_the_pod_and_binds_only_to_a_pod_of_its_account(cluster: Cluster) -> None:
    cluster.account("reader")
    pod = cluster.admin.create(PODS, {"metadata": {"name": "web"}, "spec": {
        "serviceAccountName": "reader", "containers": [{"name": "c", "image": "x"}]}})
    ref = {"apiVersion": "v1", "kind": "Pod", "name": "web", "uid": pod["metadata"]["uid"]}
    token = cluster.token("reader", boundObjectRef=ref)
    assert cluster.as_token(token).call("GET", "/api")[0] == 200
    status, answer = cluster.admin.call("POST", f"{ACCOUNTS}/default/token", {"spec": {"boundObjectRef": ref}})
    assert (status, answer["message"]) == (400, 'cannot bind token for serviceaccount "default" to pod running with '
                                                "different serviceaccount name.")
    status, answer = cluster.admin.call("POST", f"{ACCOUNTS}/reader/token",
                                        {"spec": {"boundObjectRef": {**ref, "uid": "another"}}})
    assert status == 409 and "does not match the UID in record" in answer["message"]
    cluster.admin.ok("DELETE", f"{PODS}/web", {"gracePeriodSeconds": 0})
    assert cluster.as_token(token).call("GET", "/api") == (401, UNAUTHORIZED)


@pytest.mark.parametrize(("seconds", "message"), [
    (599, "spec.expirationSeconds: Invalid value: 599: may not specify a duration less than 10 minutes"),
    (2**32 + 1, "spec.expirationSeconds: Invalid value: 4294967297: may not specify a duration larger than 2^32 "
                "seconds"),
])
def test_a_token_request_outside_the_allowed_durations_is_invalid(cluster: Cluster, seconds: int,
                                                                  message: str) -> None:
    cluster.account("reader")
    status, answer = cluster.admin.call("POST", f"{ACCOUNTS}/reader/token", {"spec": {"expirationSeconds": seconds}})
    assert (status, answer["message"]) == (422, f'TokenRequest.authentication.k8s.io "reader" is invalid: {message}')


def test_asking_for_a_token_needs_the_create_grant_on_serviceaccounts_token(cluster: Cluster) -> None:
    cluster.account("reader")
    cluster.account("minter")
    reader = cluster.as_token(cluster.token("reader"))
    status, answer = reader.call("POST", f"{ACCOUNTS}/minter/token", {"spec": {}})
    assert (status, answer["message"]) == (403, forbidden("reader", "create", "serviceaccounts/token",
                                                          name="minter"))
    cluster.grant("minting", [{"apiGroups": [""], "resources": ["serviceaccounts/token"], "verbs": ["create"],
                               "resourceNames": ["minter"]}])
    minted = reader.create(f"{ACCOUNTS}/minter/token", {"spec": {}})["status"]["token"]
    assert cluster.as_token(minted).call("GET", "/api")[0] == 200


# -- RBAC --------------------------------------------------------------------------------------------------------------


def test_a_subresource_is_granted_apart_from_its_resource(cluster: Cluster) -> None:
    import yaml

    from tests.devcluster.apiclient import CRD_FILE, CRDS, EXAMPLE

    cluster.admin.create(CRDS, yaml.safe_load(CRD_FILE.read_text()))
    cluster.admin.create(IDEPS, yaml.safe_load(EXAMPLE.read_text()))
    cluster.account("reader")
    cluster.grant("status-writer", [
        {"apiGroups": ["shardwise.io"], "resources": ["inferencedeployments/status"], "verbs": ["patch"]},
        {"apiGroups": ["shardwise.io"], "resources": ["*/scale"], "verbs": ["get"]}])
    reader = cluster.as_token(cluster.token("reader"))
    assert reader.patch(f"{IDEPS}/tiny-moe/status", {"status": {"phase": "Running"}})["status"]["phase"] == "Running"
    assert reader.get(f"{IDEPS}/tiny-moe/scale")["kind"] == "Scale"
    status, answer = reader.call("PATCH", f"{IDEPS}/tiny-moe", {"spec": {}}, content_type=MERGE)
    assert (status, answer["message"]) == (403, forbidden("reader", "patch", "inferencedeployments",
                                                          group="shardwise.io", name="tiny-moe"))
    status, answer = reader.call("PATCH", f"{IDEPS}/tiny-moe/scale", {"spec": {"replicas": 1}}, content_type=MERGE)
    assert (status, answer["message"]) == (403, forbidden("reader", "patch", "inferencedeployments/scale",
                                                          group="shardwise.io", name="tiny-moe"))


def test_resource_names_grant_named_requests_only(cluster: Cluster) -> None:
    for name in ("mine", "theirs"):
        cluster.admin.create("/api/v1/namespaces/default/configmaps", {"metadata": {"name": name}})
    cluster.account("reader")
    cluster.grant("one-map", [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"],
                               "resourceNames": ["mine"]}])
    reader = cluster.as_token(cluster.token("reader"))
    assert reader.get("/api/v1/namespaces/default/configmaps/mine")["metadata"]["name"] == "mine"
    assert reader.call("GET", "/api/v1/namespaces/default/configmaps/theirs")[0] == 403
    assert reader.call("GET", "/api/v1/namespaces/default/configmaps")[0] == 403  # a list names nothing


def test_a_role_binding_grants_a_cluster_role_in_its_namespace_only_and_a_cluster_binding_everywhere(
        cluster: Cluster) -> None:
    cluster.admin.create("/api/v1/namespaces", {"metadata": {"name": "team-a"}})
    cluster.account("reader")
    cluster.grant("read-maps", [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["list"]}],
                  namespace="team-a", cluster_role=True)
    reader = cluster.as_token(cluster.token("reader"))
    assert reader.call("GET", "/api/v1/namespaces/team-a/configmaps")[0] == 200
    assert reader.call("GET", "/api/v1/namespaces/default/configmaps")[0] == 403
    assert reader.call("GET", "/api/v1/configmaps")[0] == 403
    cluster.grant("read-everything", [{"apiGroups": ["*"], "resources": ["*"], "verbs": ["list", "deletecollection"]}],
                  namespace=None)
    assert reader.call("GET", "/api/v1/configmaps")[0] == 200
    assert reader.call("GET", "/apis/apps/v1/namespaces/default/deployments")[0] == 200
    assert reader.call("DELETE", "/api/v1/namespaces/default/configmaps")[0] == 200  # deletecollection
    assert reader.call("DELETE", "/api/v1/namespaces/default/configmaps/x")[0] == 403  # delete is not granted


def test_a_group_subject_and_a_namespaces_own_name_are_judged_as_in_kubernetes(cluster: Cluster) -> None:
    cluster.admin.create("/api/v1/namespaces", {"metadata": {"name": "team-a"}})
    cluster.account("reader")
    reader = cluster.as_token(cluster.token("reader"))
    assert reader.call("GET", "/api/v1/namespaces/team-a")[0] == 403
    cluster.admin.create(f"{RBAC}/namespaces/team-a/roles", {"metadata": {"name": "see-ns"}, "rules": [
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["get"]}]})
    cluster.admin.create(f"{RBAC}/namespaces/team-a/rolebindings", {
        "metadata": {"name": "see-ns"}, "roleRef": {"kind": "Role", "name": "see-ns"},
        "subjects": [{"kind": "Group", "name": "system:serviceaccounts:default"}]})
    assert reader.get("/api/v1/namespaces/team-a")["metadata"]["name"] == "team-a"  # in the namespace team-a
    assert reader.call("GET", "/api/v1/namespaces/default")[0] == 403


def test_a_grant_removed_is_refused_at_once(cluster: Cluster) -> None:
    cluster.account("reader")
    cluster.grant("pod-reader", [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}])
    reader = cluster.as_token(cluster.token("reader"))
    assert reader.call("GET", PODS)[0] == 200
    cluster.admin.ok("DELETE", f"{RBAC}/namespaces/default/rolebindings/pod-reader")
    assert reader.call("GET", PODS)[0] == 403


def test_self_subject_reviews_say_what_the_requester_may_do_and_who_it_is(cluster: Cluster) -> None:
    cluster.account("reader")
    cluster.grant("pod-reader", [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}])
    reader = cluster.as_token(cluster.token("reader"))
    path = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"

    def may(**attributes: str) -> bool:
        return bool(reader.create(path, {"spec": {"resourceAttributes": attributes}})["status"]["allowed"])

    assert may(verb="list", resource="pods", namespace="default")
    assert not may(verb="list", resource="pods", namespace="other")
    assert not may(verb="delete", resource="pods", namespace="default", name="web")
    review = reader.create("/apis/authentication.k8s.io/v1/selfsubjectreviews", {})
    assert review["status"]["userInfo"]["username"] == "system:serviceaccount:default:reader"


@pytest.mark.parametrize(("method", "path", "params", "expected"), [
    ("GET", "/api/v1/namespaces/ns/pods", {}, ("list", "", "pods", "", "ns", "")),
    ("GET", "/api/v1/namespaces/ns/pods", {"watch": "1"}, ("watch", "", "pods", "", "ns", "")),
    ("GET", "/api/v1/watch/namespaces/ns/pods/web", {}, ("watch", "", "pods", "", "ns", "web")),
    ("GET", "/api/v1/namespaces/ns/pods/web", {}, ("get", "", "pods", "", "ns", "web")),
    ("POST", "/api/v1/namespaces/ns/pods/web/binding", {}, ("create", "", "pods", "binding", "ns", "web")),
    ("PUT", "/apis/apps/v1/namespaces/ns/deployments/d/scale", {}, ("update", "apps", "deployments", "scale", "ns",
                                                                     "d")),
    ("PATCH", "/apis/shardwise.io/v1alpha1/namespaces/ns/inferencedeployments/x/status", {},
     ("patch", "shardwise.io", "inferencedeployments", "status", "ns", "x")),
    ("DELETE", "/api/v1/namespaces/ns/pods", {}, ("deletecollection", "", "pods", "", "ns", "")),
    ("DELETE", "/api/v1/nodes/n1", {}, ("delete", "", "nodes", "", "", "n1")),
    ("GET", "/api/v1/namespaces/team-a", {}, ("get", "", "namespaces", "", "team-a", "team-a")),
    ("GET", "/api/v1/namespaces", {}, ("list", "", "namespaces", "", "", "")),
])
def test_request_attributes_are_read_from_the_method_and_path_as_kubernetes_reads_them(
        method: str, path: str, params: dict[str, str], expected: tuple[str, ...]) -> None:
    attrs = rbac.attributes(ADMIN, method, path, params)
    assert attrs.resource_request
    assert (attrs.verb, attrs.group, attrs.resource, attrs.subresource, attrs.namespace, attrs.name) == expected


@pytest.mark.parametrize("path", ["/api", "/apis/apps/v1", "/healthz", "/version", "/openapi/v3"])
def test_discovery_and_other_paths_are_non_resource_requests(path: str) -> None:
    attrs = rbac.attributes(User("u"), "GET", path, {})
    assert not attrs.resource_request and attrs.verb == "get" and attrs.path == path


def test_a_service_accounts_user_has_its_groups() -> None:
    user = service_account_user("ns", "sa", "uid-1")
    assert user.name == "system:serviceaccount:ns:sa" and user.uid == "uid-1"
    assert user.groups == ("system:serviceaccounts", "system:serviceaccounts:ns", "system:authenticated")


# -- kubectl over HTTPS -----------------------------------------------------------------------------------------------


@pytest.fixture
def kubectl_tls(cluster: Cluster, tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[str]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    config = cluster.server.write_kubeconfig(tmp_path / "kubeconfig")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["kubectl", "--kubeconfig", str(config), "--cache-dir", str(tmp_path / "cache"),
                               *args], capture_output=True, text=True, timeout=30)

    return run


def test_kubectl_over_https_creates_tokens_and_a_tokens_user_is_judged_by_rbac(
        cluster: Cluster, kubectl_tls: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    assert kubectl_tls("create", "serviceaccount", "reader").returncode == 0
    cluster.grant("pod-reader", [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}])
    made = kubectl_tls("create", "token", "reader", "--duration=20m")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert kubectl_tls("--token", token, "auth", "can-i", "list", "pods").stdout.strip() == "yes"
    assert kubectl_tls("--token", token, "auth", "can-i", "delete", "pods").stdout.strip() == "no"
    whoami = kubectl_tls("--token", token, "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}")
    assert whoami.stdout == "system:serviceaccount:default:reader", whoami.stderr
    refused = kubectl_tls("--token", token, "get", "pods", "-n", "kube-system")
    assert refused.returncode == 1
    assert f"Error from server (Forbidden): {forbidden('reader', 'list', 'pods', namespace='kube-system')}" \
        in refused.stderr
    wrong = kubectl_tls("--token", f"bearer {token}", "get", "pods")
    assert wrong.returncode == 1 and "Unauthorized" in wrong.stderr
