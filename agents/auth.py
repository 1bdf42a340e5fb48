"""The shared token that guards the node agent's gRPC API and its control routes, and the deployment's API key.

Every call to an agent carries the metadata `authorization: Bearer <token>`; the agent compares the token
with its own in constant time and answers anything else with `UNAUTHENTICATED` before a servicer runs.
In a cluster the token comes from a Secret mounted as a file (`SHARDWISE_AGENT_TOKEN_FILE`); locally from
`SHARDWISE_AGENT_TOKEN`. The operator and `shardwise agentctl` read it the same way. Over HTTP the token guards
the pod's control routes (`/v1/abort`, `/v1/stats`: the router sends it); the deployment's API key, when it has
one (`SHARDWISE_API_KEY`, or the file `SHARDWISE_API_KEY_FILE` names), guards the OpenAI routes of the router and
of every pod alike, so that a client that goes around the router needs it too.

The token only authenticates: it is sent in clear over an insecure channel, so it keeps other pods and
people on the network from driving an agent by accident or by guess, not an eavesdropper on the pod
network (a mesh or NetworkPolicy covers that).

    server = grpc.server(pool, interceptors=[TokenAuthInterceptor(load_token())])
    channel = with_token(grpc.insecure_channel(address), load_token())
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
import grpc.aio

TOKEN_ENV = "SHARDWISE_AGENT_TOKEN"
TOKEN_FILE_ENV = "SHARDWISE_AGENT_TOKEN_FILE"
API_KEY_ENV = "SHARDWISE_API_KEY"
AUTH_KEY = "authorization"  # gRPC metadata keys are lower case
DENIED = "missing or wrong agent token"

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class AgentTokenError(RuntimeError):
    """No usable agent token is configured."""


def _secret(env: Mapping[str, str], name: str, what: str) -> str:
    """`name` if set, else the content of the file `name_FILE` names, without surrounding whitespace (a Secret
    often ends in a newline); "" when neither is set. AgentTokenError when the file cannot be read or the value
    could not travel in a header."""
    value, path = env.get(name, ""), env.get(f"{name}_FILE", "")
    if not value and path:
        try:
            value = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise AgentTokenError(f"cannot read the {what} from {name}_FILE={path}: {e}") from e
    value = value.strip()
    if value and (not (value.isascii() and value.isprintable()) or any(c.isspace() for c in value)):
        raise AgentTokenError(f"the {what} must be printable ASCII without spaces (it travels in a header)")
    return value


def load_token(environ: Mapping[str, str] | None = None) -> str:
    """The agent token: `SHARDWISE_AGENT_TOKEN`, else the file `SHARDWISE_AGENT_TOKEN_FILE` names."""
    token = _secret(os.environ if environ is None else environ, TOKEN_ENV, "agent token")
    if not token:
        raise AgentTokenError(f"no agent token: set {TOKEN_ENV}, or {TOKEN_FILE_ENV} to a file holding it")
    return token


def load_api_key(environ: Mapping[str, str] | None = None) -> str:
    """The deployment's API key (`spec.runtime.apiKeySecret`): `SHARDWISE_API_KEY`, else the file
    `SHARDWISE_API_KEY_FILE` names; "" when the deployment has none (its OpenAI API is then open)."""
    return _secret(os.environ if environ is None else environ, API_KEY_ENV, "API key")


def bearer_ok(header: str | None, secret: str) -> bool:
    """Whether an HTTP `Authorization` header is `Bearer <secret>` (constant-time on the secret; never for an
    empty secret)."""
    scheme, _, presented = (header or "").partition(" ")
    return bool(secret) and scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(),
                                                                               secret.encode())


def bearer_metadata(token: str) -> tuple[tuple[str, str]]:
    """The metadata to send with a call, e.g. `stub.Describe(request, metadata=bearer_metadata(token))`."""
    return ((AUTH_KEY, f"Bearer {token}"),)


def is_authorized(metadata: Collection[tuple[str, str | bytes]] | None, token: str) -> bool:
    """Whether the call metadata holds `authorization: Bearer <token>` (constant-time on the token)."""
    expected = token.encode()
    for key, value in metadata or ():
        if key.lower() != AUTH_KEY or not isinstance(value, str):
            continue
        scheme, _, presented = value.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), expected):
            return True
    return False


# --- server side ------------------------------------------------------------------------------------------

_HANDLER_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _denying(
    handler: grpc.RpcMethodHandler[Any, Any] | None, behavior: Callable[..., Any]
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same streaming kind as `handler` that runs `behavior`. It has no deserializer, so
    an unauthenticated request is never parsed; an unknown method is denied as a unary one."""
    kind = (handler.request_streaming, handler.response_streaming) if handler else (False, False)
    return _HANDLER_FACTORIES[kind](behavior)


def _deny(request: object, context: grpc.ServicerContext) -> NoReturn:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)


async def _deny_async(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> NoReturn:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Rejects every call without the bearer token with `UNAUTHENTICATED`, for `grpc.server`.

    `open_methods` are full method names served without a token (e.g. `/grpc.health.v1.Health/Check` for a
    kubelet gRPC probe)."""

    def __init__(self, token: str, open_methods: Collection[str] = ()) -> None:
        self._token = token
        self._open = frozenset(open_methods)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Req, Resp] | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Req, Resp] | None:
        handler = continuation(handler_call_details)
        if handler_call_details.method in self._open:
            return handler
        if is_authorized(handler_call_details.invocation_metadata, self._token):
            return handler
        return _denying(handler, _deny)


class AsyncTokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """The same check for `grpc.aio.server`."""

    def __init__(self, token: str, open_methods: Collection[str] = ()) -> None:
        self._token = token
        self._open = frozenset(open_methods)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler: grpc.RpcMethodHandler[Any, Any] | None = await continuation(handler_call_details)
        if handler_call_details.method in self._open:
            return handler
        if is_authorized(handler_call_details.invocation_metadata, self._token):
            return handler
        return _denying(handler, _deny_async)


# --- client side ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: tuple[tuple[str, str | bytes], ...] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class BearerTokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call made through a channel (see `with_token`)."""

    def __init__(self, token: str) -> None:
        self._metadata = bearer_metadata(token)

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        kept = tuple((k, v) for k, v in details.metadata or () if k.lower() != AUTH_KEY)
        return _CallDetails(details.method, details.timeout, kept + self._metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation: Callable[[grpc.ClientCallDetails, Req], Any],
                              client_call_details: grpc.ClientCallDetails, request: Req) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Callable[[grpc.ClientCallDetails, Req], Any],
                               client_call_details: grpc.ClientCallDetails, request: Req) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation: Callable[[grpc.ClientCallDetails, Iterator[Req]], Any],
                               client_call_details: grpc.ClientCallDetails, request_iterator: Iterator[Req]) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation: Callable[[grpc.ClientCallDetails, Iterator[Req]], Any],
                                client_call_details: grpc.ClientCallDetails, request_iterator: Iterator[Req]) -> Any:
        return continuation(self._details(client_call_details), request_iterator)


def with_token(channel: grpc.Channel, token: str) -> grpc.Channel:
    """`channel` with the bearer token attached to every call: `AgentStub(with_token(channel, token))`."""
    return grpc.intercept_channel(channel, BearerTokenInterceptor(token))


# --- TLS ------------------------------------------------------------------------------------------------------

#: the name every agent's certificate carries and every client checks (pods are reached by IP, so the name is
#: the deployment's CA's own, not a DNS name)
AGENT_TLS_NAME = "agent.shardwise.internal"
TLS_DIR_ENV = "SHARDWISE_AGENT_TLS_DIR"


@dataclass(frozen=True)
class AgentTls:
    """PEM bytes: the deployment's CA and this side's certificate and key (an agent's serves, the operator's is
    a client certificate: mutual TLS, both issued by the same CA)."""

    ca: bytes
    cert: bytes
    key: bytes = field(repr=False)

    @classmethod
    def from_dir(cls, directory: str | Path) -> AgentTls:
        """`ca.crt`, `tls.crt` and `tls.key` of a folder (a mounted Secret); AgentTokenError when one is missing."""
        d = Path(directory)
        try:
            return cls((d / "ca.crt").read_bytes(), (d / "tls.crt").read_bytes(), (d / "tls.key").read_bytes())
        except OSError as e:
            raise AgentTokenError(f"cannot read the agent's TLS files from {d}: {e}") from e

    @classmethod
    def client_from_dir(cls, directory: str | Path) -> AgentTls:
        """A client's: `ca.crt`, `client.crt` and `client.key` of a folder (the Secret's keys, saved as files)."""
        d = Path(directory)
        try:
            return cls((d / "ca.crt").read_bytes(), (d / "client.crt").read_bytes(), (d / "client.key").read_bytes())
        except OSError as e:
            raise AgentTokenError(f"cannot read the deployment's TLS client files from {d}: {e}") from e

    def server_credentials(self) -> grpc.ServerCredentials:
        """An agent's: its certificate, and only clients with a certificate of the same CA."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


@dataclass(frozen=True)
class AgentAuth:
    """How a client reaches a deployment's agents: the agent token, and its TLS client files where the
    deployment has them (never shown by repr: it ends up in logs)."""

    token: str = field(repr=False)
    tls: AgentTls | None = field(default=None, repr=False)


def auth_from_secret(data: Mapping[str, str]) -> AgentAuth:
    """The operator's side of a deployment's agent-token Secret (its `data`, base64 as the API returns it): the
    token and, where the Secret has them, the TLS client files."""
    import base64

    def value(key: str) -> bytes:
        return base64.b64decode(data[key])

    tls = AgentTls(value("ca.crt"), value("client.crt"), value("client.key")) if "client.crt" in data else None
    return AgentAuth(value("token").decode(), tls)


def load_tls(environ: Mapping[str, str] | None = None) -> AgentTls | None:
    """The TLS files of `SHARDWISE_AGENT_TLS_DIR`, or None when it is not set (plaintext, as locally)."""
    directory = (os.environ if environ is None else environ).get(TLS_DIR_ENV, "")
    return AgentTls.from_dir(directory) if directory else None


def agent_channel(address: str, token: str, tls: AgentTls | None = None) -> grpc.Channel:
    """A channel to an agent with the bearer token on every call: over mutual TLS when `tls` is given."""
    if tls is None:
        return with_token(grpc.insecure_channel(address), token)
    options = (("grpc.ssl_target_name_override", AGENT_TLS_NAME),)
    return with_token(grpc.secure_channel(address, tls.channel_credentials(), options=options), token)


def serve_port(server: grpc.Server, address: str, tls: AgentTls | None) -> int:
    """Bind the agent's gRPC port: mutual TLS when the deployment gave it certificates, else plaintext."""
    if tls is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, tls.server_credentials())
