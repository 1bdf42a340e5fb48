"""Mutual TLS between the operator and a deployment's agents, with the certificates the operator issues: a client
with the deployment's client certificate is served; one without a certificate, with another deployment's, or in
plaintext never reaches the servicer (its call fails before the token is even read)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from shardwise.agents import ctl
from shardwise.agents.auth import AGENT_TLS_NAME, AgentAuth, AgentTls, TokenAuthInterceptor, serve_port
from shardwise.agents.client import AgentClient
from shardwise.agents.proto import agent_pb2, agent_pb2_grpc
from shardwise.operator import certs

TOKEN = "tls-token"
FILES = certs.issue("llm")


class DescribeOnly(agent_pb2_grpc.AgentServicer):
    def Describe(self, request: agent_pb2.DescribeRequest, context: grpc.ServicerContext) -> agent_pb2.DescribeResponse:
        return agent_pb2.DescribeResponse(deployment="llm", pod_index=0, generation=3)


def agent_tls(files: dict[str, bytes]) -> AgentTls:
    return AgentTls(files["ca.crt"], files["tls.crt"], files["tls.key"])


def operator_tls(files: dict[str, bytes]) -> AgentTls:
    return AgentTls(files["ca.crt"], files[certs.CLIENT_CERT], files[certs.CLIENT_KEY])


@pytest.fixture
def address() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[TokenAuthInterceptor(TOKEN)])
    agent_pb2_grpc.add_AgentServicer_to_server(DescribeOnly(), server)
    port = serve_port(server, "127.0.0.1:0", agent_tls(FILES))
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_the_operator_with_the_deployments_client_certificate_is_served(address: str) -> None:
    with AgentClient(address, AgentAuth(TOKEN, operator_tls(FILES)), timeout=10) as c:
        assert c.describe().generation == 3


@pytest.mark.parametrize("client", [
    pytest.param(lambda: AgentAuth(TOKEN), id="plaintext"),
    pytest.param(lambda: AgentAuth(TOKEN, AgentTls(FILES["ca.crt"], b"", b"")), id="no client certificate"),
    pytest.param(lambda: AgentAuth(TOKEN, operator_tls(certs.issue("other"))), id="another deployment's"),
])
def test_a_client_without_the_deployments_certificate_never_reaches_the_agent(address: str, client: object) -> None:
    with AgentClient(address, client(), timeout=5) as c, pytest.raises(grpc.RpcError) as e:  # type: ignore[operator]
        c.describe()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_the_certificates_chain_to_the_deployments_ca_and_name_the_agent() -> None:
    ca, server, client = (x509.load_pem_x509_certificate(FILES[k]) for k in ("ca.crt", "tls.crt", certs.CLIENT_CERT))
    for cert in (server, client):
        cert.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == [AGENT_TLS_NAME]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert "ca.key" not in FILES  # nothing can issue more certificates for the deployment
    assert repr(agent_tls(FILES)).count("PRIVATE") == 0 and "tls-token" not in repr(AgentAuth(TOKEN))


def test_agentctl_reaches_a_tls_agent_with_the_secrets_client_files_and_says_what_is_missing(
        address: str, tmp_path: Path) -> None:
    for key in ("ca.crt", certs.CLIENT_CERT, certs.CLIENT_KEY):  # as `kubectl get secret NAME-agent-token` gives
        (tmp_path / key).write_bytes(FILES[key])
    assert ctl.call(address, TOKEN, "describe", tls_dir=tmp_path)["generation"] == "3"  # int64 as JSON text
    with pytest.raises(ValueError, match="UNAVAILABLE"):
        ctl.call(address, TOKEN, "describe")  # plaintext to a TLS agent
    (tmp_path / certs.CLIENT_KEY).unlink()
    with pytest.raises(ValueError, match=r"client\.key"):
        ctl.call(address, TOKEN, "describe", tls_dir=tmp_path)
