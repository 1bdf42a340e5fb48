"""The Helm chart as Helm itself renders it: helm-python-sdk runs Helm's Go engine as a library, offline, so
these tests lint and render charts/shardwise with the real template functions (genCA, lookup, required,
the values schema) and no helm binary or cluster. Each render takes milliseconds.

What a user of the chart relies on, and what is checked here: the objects each set of values creates; RBAC
that grants exactly what the operator uses; an admission webhook whose Service, port, path and certificate
meet the operator's own flags and mounted files; certificates that survive `helm upgrade`; labels on every
object; nothing outside the release namespace.
"""

from __future__ import annotations

import base64
import copy
import functools
import json
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is in the dev extra: run `make install`")
pytest.importorskip("kubernetes", reason="the operator extra: run `make install`")

from shardwise.operator.kube import PATHS as KUBE_PATHS  # noqa: E402

from tests.unit import grants_from_code  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "shardwise"
RELEASE = "sw"
NAMESPACE = "inference"
FULLNAME = "sw-shardwise"
WEBHOOK_SERVICE = f"{FULLNAME}-webhook"
TLS_SECRET = f"{FULLNAME}-webhook-tls"
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "ValidatingWebhookConfiguration"}

# A CA bundle as a user of `webhook.certificate.mode=secret` would paste it (base64 of a PEM certificate).
USER_CA = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n").decode()

VARIATIONS: dict[str, dict[str, Any]] = {
    "default values": {},
    "webhook disabled": {"webhook": {"enabled": False}},
    "cert-manager with its own self-signed Issuer": {"webhook": {"certificate": {"mode": "certManager"}}},
    "cert-manager with an existing ClusterIssuer": {"webhook": {"certificate": {
        "mode": "certManager", "certManager": {"issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}}},
    "a certificate Secret the user provides": {"webhook": {"certificate": {
        "mode": "secret", "secret": {"name": "my-webhook-tls", "caBundle": USER_CA}}}},
    "a ServiceMonitor": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
    "two replicas": {"replicas": 2},
    "a PodMonitor and the Grafana dashboard": {"podMonitor": {"enabled": True},
                                               "grafanaDashboard": {"enabled": True, "folder": "inference"}},
    "a namespaced install": {"watchNamespaces": ["team-a", "team-b"]},
}


# -- rendering ------------------------------------------------------------------------------------------------

@functools.cache
def _render(values_json: str) -> tuple[dict[str, Any], ...]:
    with helm.Chart.load(CHART) as chart:
        files = chart.render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE, is_install=True)
    return tuple(_objects(files))


def _objects(files: dict[str, str]) -> list[dict[str, Any]]:
    """Every object of every rendered template but NOTES.txt, in a stable order."""
    return [doc for path, text in sorted(files.items()) if not path.endswith("NOTES.txt")
            for doc in yaml.safe_load_all(text) if doc]


def render(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The chart's objects for these values (cached; each caller gets its own copy)."""
    return copy.deepcopy(list(_render(json.dumps(values or {}, sort_keys=True))))


def only(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def operator_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    containers = only(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    return containers[0]


def flag(command: list[str], name: str) -> str | None:
    """The value after `name` on a command line, None when the flag is absent."""
    return command[command.index(name) + 1] if name in command else None


def container_port(container: dict[str, Any], port: int | str) -> int:
    """A Service targetPort resolved against the container: a number stays, a name is looked up."""
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def webhook_values(**certificate: Any) -> dict[str, Any]:
    return {"webhook": {"certificate": certificate}}


# -- values ---------------------------------------------------------------------------------------------------

def test_every_value_is_documented_by_a_comment_in_values_yaml() -> None:
    """A key is documented by the comment lines right above it, or by those above one of its parents (a
    free-form block such as resources or securityContext is documented once, at its top)."""
    undocumented, parents = [], []  # parents: (indent, documented) of the enclosing keys
    previous = ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        key = re.match(r"^( *)([A-Za-z][\w.-]*):", line)
        if key:
            indent = len(key.group(1))
            parents = [p for p in parents if p[0] < indent]
            documented = previous.lstrip().startswith("#") or any(d for _, d in parents)
            if not documented:
                undocumented.append(key.group(2))
            parents.append((indent, previous.lstrip().startswith("#")))
        if line.strip():
            previous = line
    # keys that only group documented keys need no comment of their own
    groups = {"image", "agentImage", "serviceAccount", "rbac", "ports", "metrics", "service", "serviceMonitor",
              "webhook", "certificate", "helm", "certManager", "secret", "crds", "podMonitor", "grafanaDashboard"}
    assert sorted(set(undocumented) - groups) == [], "values without a comment in values.yaml"


# -- lint, kinds, CRD -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("values", VARIATIONS.values(), ids=VARIATIONS.keys())
def test_helm_lint_finds_no_warning_or_error(values: dict[str, Any]) -> None:
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # 1 = info ("icon is recommended")


EXPECTED_KINDS: dict[str, Counter[str]] = {
    "a PodMonitor and the Grafana dashboard": Counter({
        "ServiceAccount": 1, "ClusterRole": 1, "ClusterRoleBinding": 1, "Role": 1, "RoleBinding": 1,
        "Deployment": 1, "Service": 2, "Secret": 1, "ValidatingWebhookConfiguration": 1, "PodMonitor": 1,
        "ConfigMap": 1}),
    "default values": Counter({"ServiceAccount": 1, "ClusterRole": 1, "ClusterRoleBinding": 1, "Role": 1,
                               "RoleBinding": 1, "Deployment": 1, "Service": 2, "Secret": 1,
                               "ValidatingWebhookConfiguration": 1}),
    "webhook disabled": Counter({"ServiceAccount": 1, "ClusterRole": 1, "ClusterRoleBinding": 1, "Role": 1,
                                 "RoleBinding": 1, "Deployment": 1, "Service": 1}),
    "cert-manager with its own self-signed Issuer": Counter({
        "ServiceAccount": 1, "ClusterRole": 1, "ClusterRoleBinding": 1, "Role": 1, "RoleBinding": 1,
        "Deployment": 1, "Service": 2, "Issuer": 1, "Certificate": 1, "ValidatingWebhookConfiguration": 1}),
    "cert-manager with an existing ClusterIssuer": Counter({
        "ServiceAccount": 1, "ClusterRole": 1, "ClusterRoleBinding": 1, "Role": 1, "RoleBinding": 1,
        "Deployment": 1, "Service": 2, "Certificate": 1, "ValidatingWebhookConfiguration": 1}),
    "a certificate Secret the user provides": Counter({
        "ServiceAccount": 1, "ClusterRole": 1, "ClusterRoleBinding": 1, "Role": 1, "RoleBinding": 1,
        "Deployment": 1, "Service": 2, "ValidatingWebhookConfiguration": 1}),
    "a ServiceMonitor": Counter({"ServiceAccount": 1, "ClusterRole": 1, "ClusterRoleBinding": 1, "Role": 1,
                                "RoleBinding": 1, "Deployment": 1, "Service": 2, "Secret": 1,
                                "ValidatingWebhookConfiguration": 1, "ServiceMonitor": 1}),
    "a namespaced install": Counter({"ServiceAccount": 1, "ClusterRole": 1, "ClusterRoleBinding": 1, "Role": 3,
                                    "RoleBinding": 3, "Deployment": 1, "Service": 2, "Secret": 1,
                                    "ValidatingWebhookConfiguration": 1}),
}


@pytest.mark.parametrize("case", EXPECTED_KINDS, ids=EXPECTED_KINDS.keys())
def test_each_set_of_values_creates_exactly_these_objects(case: str) -> None:
    assert Counter(o["kind"] for o in render(VARIATIONS[case])) == EXPECTED_KINDS[case]


def test_the_crd_comes_from_crds_as_is_and_no_template_renders_one() -> None:
    with helm.Chart.load(CHART) as chart:
        crds = chart.crds
    assert [c["name"] for c in crds] == ["crds/inferencedeployments.shardwise.io.yaml"]
    assert crds[0]["data"] == (CHART / crds[0]["name"]).read_text()  # as-is: Helm does not template crds/
    assert yaml.safe_load(crds[0]["data"])["metadata"]["name"] == "inferencedeployments.shardwise.io"
    for values in VARIATIONS.values():
        assert "CustomResourceDefinition" not in {o["kind"] for o in render(values)}


def test_the_notes_render_for_every_variation() -> None:
    with helm.Chart.load(CHART) as chart:
        for values in VARIATIONS.values():
            notes = chart.render(values, name=RELEASE, namespace=NAMESPACE)["shardwise/templates/NOTES.txt"]
            assert f"deployment/{FULLNAME}" in notes


# -- RBAC -----------------------------------------------------------------------------------------------------

def _grants(group: str, resources: list[str], verbs: list[str]) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for resource in resources for verb in verbs}


# What the operator's code calls, read from it (tests/unit/grants_from_code.py), and kopf's own watches.
_RESOURCES = {kind: ("" if prefix.startswith("/api/") else prefix.split("/")[2], plural)
              for kind, (prefix, plural) in KUBE_PATHS.items()}
_CALLED = grants_from_code.operator_grants(_RESOURCES)
LEASE_GRANTS = {g for g in _CALLED if g[1] == "leases"}  # leader election, in the release namespace
NAMESPACED_GRANTS = _CALLED - LEASE_GRANTS
CLUSTER_GRANTS = grants_from_code.KOPF_CLUSTER_GRANTS
OPERATOR_GRANTS = NAMESPACED_GRANTS | CLUSTER_GRANTS


def test_the_grants_read_from_the_code_include_the_calls_a_reader_can_see() -> None:
    """The reading of the code finds what the operator plainly does (so an empty or partial reading fails)."""
    assert {("", "pods", "create"), ("", "pods", "delete"), ("", "secrets", "get"), ("", "secrets", "create"),
            ("", "events", "create"), ("shardwise.io", "inferencedeployments/status", "patch"),
            ("apps", "deployments", "create"), ("networking.k8s.io", "networkpolicies", "patch")} <= NAMESPACED_GRANTS
    assert _grants("coordination.k8s.io", ["leases"], ["get", "create", "update"]) == LEASE_GRANTS
    # never a list or watch of Secrets, never an update of the custom resource (kopf and the operator patch)
    assert not {g for g in _CALLED if g[1] == "secrets" and g[2] in ("list", "watch")}
    assert ("shardwise.io", "inferencedeployments", "update") not in _CALLED


def _granted(rules: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """Every (group, resource, verb) the rules allow; a list, so that a rule repeated twice shows."""
    for rule in rules:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, f"unexpected rule fields: {rule}"
    return [(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]]


def test_the_cluster_role_grants_exactly_what_the_operator_uses() -> None:
    granted = _granted(only(render(), "ClusterRole")["rules"])
    assert not [g for g in granted if "*" in g], "no wildcards"
    assert len(granted) == len(set(granted)), "a grant is repeated"
    assert set(granted) - OPERATOR_GRANTS == set(), "granted but not used by the operator"
    assert OPERATOR_GRANTS - set(granted) == set(), "used by the operator but not granted"


def test_a_namespaced_install_grants_in_its_namespaces_only_and_watches_only_them() -> None:
    objects = render({"watchNamespaces": ["team-a", "team-b"]})
    assert set(_granted(only(objects, "ClusterRole")["rules"])) == CLUSTER_GRANTS  # names and the CRD, no more
    for ns in ("team-a", "team-b"):
        role = next(o for o in objects if o["kind"] == "Role" and o["metadata"]["namespace"] == ns)
        granted = _granted(role["rules"])
        assert len(granted) == len(set(granted)) and set(granted) == NAMESPACED_GRANTS
        binding = next(o for o in objects if o["kind"] == "RoleBinding" and o["metadata"]["namespace"] == ns)
        assert binding["roleRef"]["name"] == role["metadata"]["name"] and binding["roleRef"]["kind"] == "Role"
        assert binding["subjects"][0]["namespace"] == NAMESPACE
    command = operator_container(objects)["command"]
    assert "--all-namespaces" not in command
    assert [command[i + 1] for i, part in enumerate(command) if part == "--namespace"] == ["team-a", "team-b"]
    selector = only(objects, "ValidatingWebhookConfiguration")["webhooks"][0]["namespaceSelector"]
    assert selector == {"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In",
                                              "values": ["team-a", "team-b"]}]}
    # the default install watches every namespace, and its webhook sees them all
    assert "--all-namespaces" in operator_container(render())["command"]
    assert "namespaceSelector" not in only(render(), "ValidatingWebhookConfiguration")["webhooks"][0]


def test_leader_election_is_a_role_on_leases_in_the_release_namespace_only() -> None:
    objects = render({"replicas": 2})
    role = only(objects, "Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert set(_granted(role["rules"])) == LEASE_GRANTS
    command = operator_container(objects)["command"]
    assert flag(command, "--leader-election-namespace") == "$(POD_NAMESPACE)"
    assert flag(command, "--leader-election-name") == f"{FULLNAME}-leader"
    assert only(objects, "Deployment")["spec"]["replicas"] == 2
    # A new pod cannot become Ready while an old one leads, so a rolling update would never finish.
    assert only(objects, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}


def test_both_bindings_give_their_role_to_the_operator_service_account() -> None:
    objects = render()
    account = only(objects, "ServiceAccount")["metadata"]["name"]
    assert only(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == account
    for binding_kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        binding = only(objects, binding_kind)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind,
                                      "name": only(objects, role_kind)["metadata"]["name"]}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]


def test_rbac_and_service_account_can_be_brought_by_the_user() -> None:
    objects = render({"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "platform-sa"}})
    assert {o["kind"] for o in objects} & {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                                           "RoleBinding"} == set()
    assert only(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "platform-sa"


# -- the operator Deployment ----------------------------------------------------------------------------------

def test_the_operator_command_line_with_default_values() -> None:
    assert operator_container(render())["command"] == [
        "shardwise", "operator", "--all-namespaces",
        "--health-port", "8080", "--metrics-port", "9090",
        "--webhook-port", "9443",
        "--webhook-cert", "/etc/shardwise/webhook/tls.crt", "--webhook-key", "/etc/shardwise/webhook/tls.key",
        "--leader-election-namespace", "$(POD_NAMESPACE)", "--leader-election-name", f"{FULLNAME}-leader",
        "--agent-image", "shardwise:0.1.0",
        "--network-policy-namespace", "$(POD_NAMESPACE)",
    ]


def test_the_prometheus_servers_the_admin_allows_reach_the_operator() -> None:
    command = operator_container(render({"prometheusAllow": ["http://prometheus.monitoring:9090",
                                                              "https://thanos.example/prom"]}))["command"]
    i = command.index("--prometheus-allow")
    assert command[i:i + 4] == ["--prometheus-allow", "http://prometheus.monitoring:9090",
                                "--prometheus-allow", "https://thanos.example/prom"]


def test_the_pod_knows_its_namespace_and_name_from_the_downward_api() -> None:
    env = {e["name"]: e for e in operator_container(render())["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}


def test_probes_and_metrics_service_reach_the_ports_the_operator_listens_on() -> None:
    objects = render({"ports": {"health": 8181, "metrics": 9191}})
    container = operator_container(objects)
    command = container["command"]
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/healthz"
        assert container_port(container, get["port"]) == int(flag(command, "--health-port") or 0) == 8181
    service = only(objects, "Service", f"{FULLNAME}-metrics")
    [port] = service["spec"]["ports"]
    assert port["name"] == "metrics" and port["port"] == 9191
    assert container_port(container, port["targetPort"]) == int(flag(command, "--metrics-port") or 0) == 9191
    pod_labels = only(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_image_tag_defaults_to_the_app_version_and_agents_run_the_same_image() -> None:
    assert operator_container(render())["image"] == "shardwise:0.1.0"
    container = operator_container(render({"image": {"repository": "registry.example/shardwise", "tag": "0.2.0"}}))
    assert container["image"] == "registry.example/shardwise:0.2.0"
    assert flag(container["command"], "--agent-image") == "registry.example/shardwise:0.2.0"
    container = operator_container(render({"agentImage": {"repository": "registry.example/agent", "tag": "gpu"}}))
    assert container["image"] == "shardwise:0.1.0"
    assert flag(container["command"], "--agent-image") == "registry.example/agent:gpu"


def test_the_operator_runs_unprivileged_on_a_read_only_root_filesystem() -> None:
    objects = render()
    pod = only(objects, "Deployment")["spec"]["template"]["spec"]
    container = operator_container(objects)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    tmp = next(v for v in pod["volumes"] if v["name"] == "tmp")
    assert tmp == {"name": "tmp", "emptyDir": {}}
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_scheduling_and_resources_come_from_values() -> None:
    values = {
        "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "priorityClassName": "system-cluster-critical",
    }
    objects = render(values)
    pod = only(objects, "Deployment")["spec"]["template"]["spec"]
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        assert pod[key] == values[key]
    assert operator_container(objects)["resources"] == values["resources"]


# -- the admission webhook ------------------------------------------------------------------------------------

def _webhook(objects: list[dict[str, Any]]) -> dict[str, Any]:
    configuration = only(objects, "ValidatingWebhookConfiguration", FULLNAME)
    [webhook] = configuration["webhooks"]
    return webhook


WEBHOOK_CASES = {k: VARIATIONS[k] for k in ("default values", "cert-manager with its own self-signed Issuer",
                                             "a certificate Secret the user provides")}


@pytest.mark.parametrize("values", WEBHOOK_CASES.values(), ids=WEBHOOK_CASES.keys())
def test_the_api_server_reaches_the_webhook_server_the_operator_runs(values: dict[str, Any]) -> None:
    objects = render(values)
    webhook = _webhook(objects)
    container = operator_container(objects)
    command = container["command"]
    service_ref = webhook["clientConfig"]["service"]
    assert service_ref == {"name": WEBHOOK_SERVICE, "namespace": NAMESPACE,
                           "path": "/validate-inferencedeployment", "port": 443}
    service = only(objects, "Service", WEBHOOK_SERVICE)
    [port] = [p for p in service["spec"]["ports"] if p["port"] == service_ref["port"]]
    assert container_port(container, port["targetPort"]) == int(flag(command, "--webhook-port") or 0) == 9443
    pod_labels = only(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()

    # --webhook-cert and --webhook-key are files of the mounted certificate Secret.
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "webhook-cert"]
    volume = next(v for v in only(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]
                  if v["name"] == "webhook-cert")
    assert mount["mountPath"] == "/etc/shardwise/webhook" and mount["readOnly"] is True
    assert flag(command, "--webhook-cert") == f"{mount['mountPath']}/tls.crt"
    assert flag(command, "--webhook-key") == f"{mount['mountPath']}/tls.key"
    mode = values.get("webhook", {}).get("certificate", {}).get("mode", "helm")
    expected_secret = "my-webhook-tls" if mode == "secret" else TLS_SECRET
    assert volume["secret"]["secretName"] == expected_secret


def test_the_webhook_validates_creates_and_updates_of_inference_deployments_and_their_scale() -> None:
    webhook = _webhook(render())
    assert webhook["name"] == "validate.inferencedeployments.shardwise.io"
    assert webhook["rules"] == [{"apiGroups": ["shardwise.io"], "apiVersions": ["v1alpha1"],
                                 "resources": ["inferencedeployments", "inferencedeployments/scale"],
                                 "operations": ["CREATE", "UPDATE"],
                                 "scope": "Namespaced"}]
    assert webhook["sideEffects"] == "None"
    assert webhook["admissionReviewVersions"] == ["v1"]
    assert webhook["failurePolicy"] == "Fail"
    assert webhook["timeoutSeconds"] == 10
    assert _webhook(render({"webhook": {"failurePolicy": "Ignore"}}))["failurePolicy"] == "Ignore"


def test_without_the_webhook_there_is_no_webhook_flag_port_volume_service_or_secret() -> None:
    objects = render({"webhook": {"enabled": False}})
    container = operator_container(objects)
    assert not [a for a in container["command"] if a.startswith("--webhook")]
    assert "webhook" not in [p["name"] for p in container["ports"]]
    assert [m["name"] for m in container["volumeMounts"]] == ["tmp"]
    assert [o["metadata"]["name"] for o in objects if o["kind"] in ("Service", "Secret")] == [f"{FULLNAME}-metrics"]


def _secret_pem(objects: list[dict[str, Any]]) -> dict[str, bytes]:
    secret = only(objects, "Secret", TLS_SECRET)
    assert secret["type"] == "kubernetes.io/tls"
    return {key: base64.b64decode(value) for key, value in secret["data"].items()}


def test_helm_mode_stores_a_ca_and_a_serving_certificate_and_trusts_that_ca() -> None:
    objects = render()
    pem = _secret_pem(objects)
    assert set(pem) == {"tls.crt", "tls.key", "ca.crt"}
    assert pem["tls.crt"].startswith(b"-----BEGIN CERTIFICATE-----")
    assert pem["ca.crt"].startswith(b"-----BEGIN CERTIFICATE-----")
    assert re.match(rb"-----BEGIN (RSA |EC )?PRIVATE KEY-----", pem["tls.key"])
    ca_bundle = _webhook(objects)["clientConfig"]["caBundle"]
    assert ca_bundle and base64.b64decode(ca_bundle) == pem["ca.crt"]


def _inspect(cert: bytes, key: bytes, ca: bytes, tmp: Path) -> tuple[set[str], bool, bool]:
    """(DNS names of the certificate, signed by the CA, key belongs to the certificate), read with the
    `cryptography` package when installed, else with the openssl command line."""
    try:
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
    except ImportError:
        return _inspect_with_openssl(cert, key, ca, tmp)
    certificate = x509.load_pem_x509_certificate(cert)
    names = set(certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
                .value.get_values_for_type(x509.DNSName))
    try:
        certificate.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))
        signed = True
    except (InvalidSignature, ValueError, TypeError):
        signed = False
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    private = serialization.load_pem_private_key(key, password=None)
    matches = private.public_key().public_bytes(*spki) == certificate.public_key().public_bytes(*spki)
    return names, signed, matches


def _inspect_with_openssl(cert: bytes, key: bytes, ca: bytes, tmp: Path) -> tuple[set[str], bool, bool]:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("neither the cryptography package nor the openssl command is here to read the certificate "
                    "(the PEM form is checked by test_helm_mode_stores_a_ca_and_a_serving_certificate...)")
    files = {}
    for name, data in (("cert.pem", cert), ("key.pem", key), ("ca.pem", ca)):
        files[name] = tmp / name
        files[name].write_bytes(data)

    def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([openssl, *map(str, args)], capture_output=True, text=True, timeout=30)

    san = run("x509", "-in", files["cert.pem"], "-noout", "-ext", "subjectAltName")
    assert san.returncode == 0, san.stderr
    names = set(re.findall(r"DNS:([^,\s]+)", san.stdout))
    signed = run("verify", "-CAfile", files["ca.pem"], files["cert.pem"]).returncode == 0
    from_cert = run("x509", "-in", files["cert.pem"], "-noout", "-pubkey")
    from_key = run("pkey", "-in", files["key.pem"], "-pubout")
    return names, signed, from_cert.returncode == 0 and from_cert.stdout == from_key.stdout


def test_helm_mode_certificate_names_the_webhook_service_and_is_signed_by_the_trusted_ca(tmp_path: Path) -> None:
    pem = _secret_pem(render())
    names, signed, key_matches = _inspect(pem["tls.crt"], pem["tls.key"], pem["ca.crt"], tmp_path)
    assert {WEBHOOK_SERVICE, f"{WEBHOOK_SERVICE}.{NAMESPACE}", f"{WEBHOOK_SERVICE}.{NAMESPACE}.svc"} <= names
    assert signed, "the serving certificate is not signed by the CA in caBundle"
    assert key_matches, "tls.key is not the certificate's key"


def test_the_operator_serves_reviews_over_tls_with_the_charts_certificate(tmp_path: Path) -> None:
    """What the API server does: TLS to the webhook Service's name, trusting the caBundle, then a review."""
    import http.client
    import socket
    import ssl

    from shardwise.operator import webhook

    pem = _secret_pem(render())
    for key, data in pem.items():
        (tmp_path / key).write_bytes(data)
    server = webhook.serve("127.0.0.1", 0, str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))
    port = server.server_address[1]
    context = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))

    class ToService(http.client.HTTPSConnection):
        def connect(self) -> None:  # the Service's name is checked against the certificate; the socket is local
            self.sock = context.wrap_socket(socket.create_connection(("127.0.0.1", port), 10),
                                            server_hostname=self.host)

    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u-1", "operation": "CREATE", "object": {"spec": {"model": {"preset": "tiny-moe"},
                                                                 "parallelism": {"tp": 3}}}}}
    conn = ToService(f"{WEBHOOK_SERVICE}.{NAMESPACE}.svc", port, timeout=10)
    try:
        conn.request("POST", "/validate-inferencedeployment", json.dumps(review),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        answer = json.loads(r.read())["response"]
    finally:
        conn.close()
        server.shutdown()
        server.server_close()
    assert r.status == 200 and answer["uid"] == "u-1" and answer["allowed"] is False
    assert "spec.parallelism.tp" in answer["status"]["message"]


def test_an_upgrade_keeps_the_certificate_it_finds_in_the_cluster() -> None:
    """`lookup` needs an API server: the project's emulator (shardwise.devcluster) plays it, holding the
    Secret of the first install. Without one (offline render, `helm template`) every render draws a new CA."""
    pytest.importorskip("kmock", reason="the local API server needs the devcluster extra")
    from shardwise.devcluster.apiserver import APIServer

    from tests.devcluster.apiclient import Client

    installed = render()
    secret = only(installed, "Secret", TLS_SECRET)
    with APIServer() as server, helm.Chart.load(CHART) as chart:
        api = Client(server.url)
        api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        api.create(f"/api/v1/namespaces/{NAMESPACE}/secrets", secret)
        with helm.Config(kube_apiserver=server.url, namespace=NAMESPACE) as cluster:
            files = cluster.render(chart, {}, name=RELEASE, namespace=NAMESPACE, is_upgrade=True)
    upgraded = _objects(files)
    assert only(upgraded, "Secret", TLS_SECRET)["data"] == secret["data"]
    assert _webhook(upgraded)["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
    with helm.Chart.load(CHART) as chart:  # not the cached render(): a fresh one, with no cluster to look in
        fresh = _objects(chart.render({}, name=RELEASE, namespace=NAMESPACE, is_install=True))
    assert only(fresh, "Secret", TLS_SECRET)["data"]["ca.crt"] != secret["data"]["ca.crt"]


@pytest.mark.parametrize("issuer", [None, {"name": "corp-ca", "kind": "ClusterIssuer"}], ids=["own", "existing"])
def test_cert_manager_mode_issues_the_certificate_and_injects_its_ca(issuer: dict[str, str] | None) -> None:
    objects = render(webhook_values(mode="certManager", certManager={"issuerRef": issuer or {}}))
    certificate = only(objects, "Certificate")
    name = certificate["metadata"]["name"]
    configuration = only(objects, "ValidatingWebhookConfiguration")
    assert configuration["metadata"]["annotations"] == {"cert-manager.io/inject-ca-from": f"{NAMESPACE}/{name}"}
    assert "caBundle" not in _webhook(objects)["clientConfig"]
    assert certificate["spec"]["dnsNames"] == [WEBHOOK_SERVICE, f"{WEBHOOK_SERVICE}.{NAMESPACE}",
                                               f"{WEBHOOK_SERVICE}.{NAMESPACE}.svc"]
    assert certificate["spec"]["secretName"] == TLS_SECRET
    if issuer is None:
        own = only(objects, "Issuer")
        assert own["spec"] == {"selfSigned": {}}
        assert certificate["spec"]["issuerRef"] == {"name": own["metadata"]["name"], "kind": "Issuer",
                                                    "group": "cert-manager.io"}
    else:
        assert "Issuer" not in {o["kind"] for o in objects}
        assert certificate["spec"]["issuerRef"] == {**issuer, "group": "cert-manager.io"}


def test_secret_mode_mounts_the_users_secret_and_trusts_the_users_ca() -> None:
    objects = render(webhook_values(mode="secret", secret={"name": "my-webhook-tls", "caBundle": USER_CA}))
    assert _webhook(objects)["clientConfig"]["caBundle"] == USER_CA
    assert "Secret" not in {o["kind"] for o in objects}


@pytest.mark.parametrize(("secret", "message"), [
    ({"caBundle": USER_CA}, "needs webhook.certificate.secret.name"),
    ({"name": "my-webhook-tls"}, "needs webhook.certificate.secret.caBundle"),
], ids=["no secret name", "no CA bundle"])
def test_secret_mode_without_its_values_fails_with_a_message_naming_the_missing_value(
        secret: dict[str, str], message: str) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmRenderError, match=message):
        chart.render(webhook_values(mode="secret", secret=secret), name=RELEASE, namespace=NAMESPACE)


@pytest.mark.parametrize(("values", "message"), [
    (webhook_values(mode="selfSigned"), "/webhook/certificate/mode"),
    ({"replica": 2}, "replica"),
    ({"webhook": {"failurePolicy": "Retry"}}, "/webhook/failurePolicy"),
    ({"ports": {"webhook": 70000}}, "/ports/webhook"),
], ids=["unknown certificate mode", "misspelt key", "unknown failure policy", "port out of range"])
def test_the_values_schema_rejects_mistakes_before_anything_renders(values: dict[str, Any], message: str) -> None:
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match=message):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


# -- metrics --------------------------------------------------------------------------------------------------

def test_the_service_monitor_scrapes_the_metrics_service() -> None:
    objects = render({"serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prometheus"}}})
    monitor = only(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    selected = [o for o in objects if o["kind"] == "Service"
                and monitor["spec"]["selector"]["matchLabels"].items() <= o["metadata"]["labels"].items()]
    assert [s["metadata"]["name"] for s in selected] == [f"{FULLNAME}-metrics"]
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in [p["name"] for p in selected[0]["spec"]["ports"]]
    assert endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"


# -- every object ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("values", VARIATIONS.values(), ids=VARIATIONS.keys())
def test_every_object_carries_the_standard_labels(values: dict[str, Any]) -> None:
    objects = render(values)
    deployment = only(objects, "Deployment")
    labelled = [(f"{o['kind']}/{o['metadata']['name']}", o["metadata"].get("labels", {})) for o in objects]
    labelled.append(("the operator pods", deployment["spec"]["template"]["metadata"]["labels"]))
    for what, labels in labelled:
        assert labels.get("app.kubernetes.io/name") == "shardwise", what
        assert labels.get("app.kubernetes.io/instance") == RELEASE, what
        assert labels.get("app.kubernetes.io/version") == "0.1.0", what
        assert labels.get("app.kubernetes.io/managed-by") == "Helm", what
        assert labels.get("app.kubernetes.io/component") in {"operator", "metrics", "webhook", "dashboard"}, what
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert "app.kubernetes.io/version" not in selector, "a selector must survive an upgrade"
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def _namespaces(node: Any) -> list[str]:
    """Every value of a `namespace` key anywhere in an object, and every entry of `matchNames`."""
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k == "namespace" and isinstance(v, str)]
        found += node.get("matchNames", []) if isinstance(node.get("matchNames"), list) else []
        return found + [n for v in node.values() for n in _namespaces(v)]
    if isinstance(node, list):
        return [n for v in node for n in _namespaces(v)]
    return []


@pytest.mark.parametrize("values", VARIATIONS.values(), ids=VARIATIONS.keys())
def test_no_object_names_a_namespace_other_than_the_release_namespace(values: dict[str, Any]) -> None:
    """(but the watched namespaces of a namespaced install, which hold its Roles and RoleBindings)"""
    watched = set(values.get("watchNamespaces", []))
    for obj in render(values):
        what = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"], f"{what} is cluster-scoped"
        elif obj["kind"] in ("Role", "RoleBinding") and obj["metadata"].get("namespace") in watched:
            continue
        else:
            assert obj["metadata"].get("namespace") == NAMESPACE, what
        assert set(_namespaces(obj)) <= {NAMESPACE}, what
        inject = obj["metadata"].get("annotations", {}).get("cert-manager.io/inject-ca-from")
        assert inject is None or inject.split("/")[0] == NAMESPACE, what


def test_object_names_follow_the_release_and_stay_valid_dns_labels() -> None:
    # Release "shardwise" names its objects "shardwise", not "shardwise-shardwise"; the longest release name
    # Helm accepts (53) still gives names of at most 63 characters, as Services need.
    with helm.Chart.load(CHART) as chart:
        same = _objects(chart.render({}, name="shardwise", namespace=NAMESPACE))
        long = _objects(chart.render({}, name="a" * 53, namespace=NAMESPACE))
    assert only(same, "Deployment")["metadata"]["name"] == "shardwise"
    for obj in long:
        assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]


def test_router_settings_reach_the_operator() -> None:
    command = operator_container(render({"router": {"endpointPicker": "gw-epp:9002"}}))["command"]
    assert flag(command, "--endpoint-picker") == "gw-epp:9002"


def test_the_network_policy_can_be_turned_off() -> None:
    assert flag(operator_container(render({"networkPolicy": {"enabled": False}}))["command"],
                "--network-policy-namespace") is None


class _Yaml12(yaml.SafeLoader):
    """Reads `1e-06` as the number YAML 1.2 (Go's parser, so the API server) takes it for; PyYAML's 1.1 rules
    want a dot in a float and would read a string."""


_Yaml12.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def test_with_crds_manage_the_chart_renders_the_crd_so_helm_upgrades_it_and_keeps_it_on_uninstall() -> None:
    with helm.Chart.load(CHART) as chart:
        files = chart.render({"crds": {"manage": True}}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    crd = yaml.load(files["shardwise/templates/crd.yaml"], Loader=_Yaml12)
    source = yaml.safe_load((ROOT / "crds" / "inferencedeployments.shardwise.io.yaml").read_text())
    assert crd["spec"] == source["spec"] and crd["metadata"]["name"] == source["metadata"]["name"]
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert crd["metadata"]["labels"]["app.kubernetes.io/component"] == "crd"


def test_the_pod_monitor_selects_the_worker_and_router_pods_the_operator_builds() -> None:
    from shardwise.operator import builders

    monitor = only(render(VARIATIONS["a PodMonitor and the Grafana dashboard"]), "PodMonitor")
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"any": True} and spec["podMetricsEndpoints"][0]["port"] == "metrics"
    for component in ("worker", "router"):
        labels = builders.labels("web", component)
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        [expression] = spec["selector"]["matchExpressions"]
        assert labels[expression["key"]] in expression["values"]
    assert builders.labels("web", "plan")["app.kubernetes.io/component"] not in expression["values"]


def test_the_dashboard_configmap_carries_the_dashboard_file_as_is_with_the_sidecar_label() -> None:
    config = only(render(VARIATIONS["a PodMonitor and the Grafana dashboard"]), "ConfigMap")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config["metadata"]["annotations"] == {"grafana_folder": "inference"}
    source = (CHART / "dashboards" / "shardwise-deployment.json").read_text()
    assert json.loads(config["data"]["shardwise-deployment.json"]) == json.loads(source)
