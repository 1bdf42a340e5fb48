"""The node agent's gRPC contract: the committed stubs are what `make proto` makes of agent.proto today, and
no call reaches the agent without the shared token."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import grpc.aio
import pytest
from shardwise.agents.auth import (
    AgentTokenError,
    AsyncTokenAuthInterceptor,
    TokenAuthInterceptor,
    bearer_metadata,
    bearer_ok,
    load_api_key,
    load_token,
    with_token,
)
from shardwise.agents.proto import agent_pb2, agent_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "agents" / "proto" / "shardwise" / "agent" / "v1"
GENERATED = ["agent_pb2.py", "agent_pb2.pyi", "agent_pb2_grpc.py"]
TOKEN = "s3cret-token"


@pytest.mark.slow
def test_the_committed_stubs_are_byte_for_byte_what_make_proto_generates_from_agent_proto(tmp_path: Path) -> None:
    make = shutil.which("make")
    assert make, "`make` is needed to regenerate the stubs the way `make proto` does"
    subprocess.run([make, "-s", "-C", str(ROOT), "proto", "PROTO_DEPS=", f"BIN={Path(sys.executable).parent}",
                    f"PROTO_OUT={tmp_path}"], check=True, capture_output=True, timeout=120)
    fresh = tmp_path / "shardwise" / "agent" / "v1"
    assert sorted(p.name for p in fresh.iterdir()) == GENERATED
    for name in GENERATED:
        assert (fresh / name).read_bytes() == (STUBS / name).read_bytes(), f"{name} is stale: run `make proto`"


def test_the_stubs_import_under_the_package_and_register_the_canonical_proto_name() -> None:
    assert agent_pb2.DESCRIPTOR.name == "shardwise/agent/v1/agent.proto"
    assert agent_pb2.DESCRIPTOR.package == "shardwise.agent.v1"
    assert agent_pb2_grpc.AgentStub is not None
    methods = set(agent_pb2.DESCRIPTOR.services_by_name["Agent"].methods_by_name)
    assert methods == {"Describe", "Health", "Configure", "Prepare", "Pause", "Switch", "Resume", "MigrateExperts",
                       "UpdateExpertMap", "Drain", "Abort", "RestartStuck", "StreamExpertLoad", "Stats",
                       "WatchHealth"}


def test_every_mutating_request_and_its_response_carry_the_world_generation() -> None:
    for name in ["Configure", "Prepare", "Pause", "Switch", "Resume", "MigrateExperts", "UpdateExpertMap", "Drain",
                 "Abort", "RestartStuck"]:
        method = agent_pb2.DESCRIPTOR.services_by_name["Agent"].methods_by_name[name]
        for message in (method.input_type, method.output_type):
            field = message.fields_by_name.get("generation")
            assert field is not None and field.type == field.TYPE_UINT64, f"{message.name} lacks uint64 generation"


class DescribeOnly(agent_pb2_grpc.AgentServicer):
    def Describe(self, request: agent_pb2.DescribeRequest, context: grpc.ServicerContext) -> agent_pb2.DescribeResponse:
        return agent_pb2.DescribeResponse(deployment="demo", pod_index=1, generation=7)


@pytest.fixture
def agent_address() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[TokenAuthInterceptor(TOKEN)])
    agent_pb2_grpc.add_AgentServicer_to_server(DescribeOnly(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


CALLERS = [
    pytest.param(None, grpc.StatusCode.UNAUTHENTICATED, id="a call without a token is refused as unauthenticated"),
    pytest.param("wrong-token", grpc.StatusCode.UNAUTHENTICATED, id="a call with a wrong token is refused"),
    pytest.param(TOKEN[:-1], grpc.StatusCode.UNAUTHENTICATED, id="a call with a prefix of the token is refused"),
    pytest.param(TOKEN, grpc.StatusCode.OK, id="a call with the shared token is served"),
]


@pytest.mark.parametrize("token,code", CALLERS)
def test_describe_is_served_only_with_the_shared_token(agent_address: str, token: str | None,
                                                       code: grpc.StatusCode) -> None:
    with grpc.insecure_channel(agent_address) as channel:
        stub = agent_pb2_grpc.AgentStub(channel if token is None else with_token(channel, token))
        try:
            reply = stub.Describe(agent_pb2.DescribeRequest(), timeout=10)
        except grpc.RpcError as e:
            assert e.code() == code
            assert code != grpc.StatusCode.OK, e.details()
        else:
            assert code == grpc.StatusCode.OK
            assert (reply.deployment, reply.pod_index, reply.generation) == ("demo", 1, 7)


@pytest.mark.parametrize("token,code", [
    pytest.param(None, grpc.StatusCode.UNAUTHENTICATED, id="without a token a stream is refused before it starts"),
    pytest.param(TOKEN, grpc.StatusCode.UNIMPLEMENTED, id="with the token the stream reaches the servicer"),
])
def test_a_server_streaming_call_is_guarded_the_same_way(agent_address: str, token: str | None,
                                                         code: grpc.StatusCode) -> None:
    with grpc.insecure_channel(agent_address) as channel:
        stub = agent_pb2_grpc.AgentStub(channel if token is None else with_token(channel, token))
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.StreamExpertLoad(agent_pb2.StreamExpertLoadRequest(window_steps=8), timeout=10))
        assert raised.value.code() == code


@pytest.mark.parametrize("token,code", [
    pytest.param(None, grpc.StatusCode.UNAUTHENTICATED, id="an asyncio agent refuses a call without a token"),
    pytest.param(TOKEN, grpc.StatusCode.OK, id="an asyncio agent serves a call with the token"),
])
def test_the_asyncio_interceptor_guards_the_same_way(token: str | None, code: grpc.StatusCode) -> None:
    class AsyncDescribe(agent_pb2_grpc.AgentServicer):
        async def Describe(self, request: agent_pb2.DescribeRequest,
                           context: grpc.aio.ServicerContext[object, object]) -> agent_pb2.DescribeResponse:
            return agent_pb2.DescribeResponse(deployment="demo")

    async def call() -> grpc.StatusCode:
        server = grpc.aio.server(interceptors=[AsyncTokenAuthInterceptor(TOKEN)])
        agent_pb2_grpc.add_AgentServicer_to_server(AsyncDescribe(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                metadata = bearer_metadata(token) if token else None
                try:
                    await agent_pb2_grpc.AgentStub(channel).Describe(agent_pb2.DescribeRequest(), metadata=metadata,
                                                                      timeout=10)
                except grpc.aio.AioRpcError as e:
                    return e.code()
                return grpc.StatusCode.OK
        finally:
            await server.stop(grace=None)

    assert asyncio.run(call()) == code


def test_the_token_comes_from_the_env_var_or_else_from_the_mounted_secret_file(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("from-file\n")
    assert load_token({"SHARDWISE_AGENT_TOKEN": "from-env"}) == "from-env"
    assert load_token({"SHARDWISE_AGENT_TOKEN_FILE": str(secret)}) == "from-file"
    assert load_token({"SHARDWISE_AGENT_TOKEN": "from-env", "SHARDWISE_AGENT_TOKEN_FILE": str(secret)}) == "from-env"


def test_the_api_key_comes_from_the_env_var_or_the_mounted_file_and_is_optional(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-from-file\n")
    assert load_api_key({}) == ""  # a deployment without apiKeySecret: an open OpenAI API
    assert load_api_key({"SHARDWISE_API_KEY_FILE": str(key)}) == "sk-from-file"
    assert load_api_key({"SHARDWISE_API_KEY": "sk-env", "SHARDWISE_API_KEY_FILE": str(key)}) == "sk-env"
    with pytest.raises(AgentTokenError, match="cannot read the API key"):
        load_api_key({"SHARDWISE_API_KEY_FILE": str(tmp_path / "absent")})


@pytest.mark.parametrize(("header", "ok"), [("Bearer s3", True), ("bearer s3", True), ("Bearer  s3 ", True),
                                            ("Bearer s4", False), ("s3", False), ("Basic s3", False), (None, False)])
def test_a_bearer_header_is_checked_against_the_secret(header: str | None, ok: bool) -> None:
    assert bearer_ok(header, "s3") is ok
    assert not bearer_ok(header, "")  # no secret configured never lets a header through


@pytest.mark.parametrize("environ", [
    pytest.param({}, id="no token configured at all"),
    pytest.param({"SHARDWISE_AGENT_TOKEN": "  \n"}, id="a blank token"),
    pytest.param({"SHARDWISE_AGENT_TOKEN": "two words"}, id="a token that cannot travel in a header"),
    pytest.param({"SHARDWISE_AGENT_TOKEN_FILE": "/nonexistent/token"}, id="a token file that does not exist"),
])
def test_an_agent_without_a_usable_token_refuses_to_start(environ: dict[str, str]) -> None:
    with pytest.raises(AgentTokenError):
        load_token(environ)
