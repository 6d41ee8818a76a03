"""Server reflection serves the wire contract with the comments its .proto files hold."""

from __future__ import annotations

import re

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pergrad.server.main import RunningServer, start
from tests.conftest import ROOT
from tests.helpers import loopback_config

PROTOS = ROOT / "protos"


HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"
SERVICE = "pergrad.v1.GradientService"


def _files(
    server: RunningServer, symbol: str, port: int | None = None
) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    with grpc.insecure_channel(f"127.0.0.1:{port or server.port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
        (reply,) = stub.ServerReflectionInfo(iter([request]), timeout=10)
    protos = [
        descriptor_pb2.FileDescriptorProto.FromString(data)
        for data in reply.file_descriptor_response.file_descriptor_proto
    ]
    return {p.name: p for p in protos}


def _comments(proto: descriptor_pb2.FileDescriptorProto) -> str:
    return " ".join(
        " ".join(location.leading_comments.split()) for location in proto.source_code_info.location
    )


def _proto_comment_before(path: str, declaration: str) -> str:
    """The // lines right above `declaration` in the .proto file, as one line of words."""
    text = (PROTOS / path).read_text()
    block = re.search(rf"((?:^[ \t]*//.*\n)+)[ \t]*{re.escape(declaration)}", text, re.M)
    return " ".join(line.strip().removeprefix("//").strip() for line in block[1].splitlines())


def test_the_services_file_comes_with_its_comments_and_its_imports(server: RunningServer) -> None:
    files = _files(server, "pergrad.v1.GradientService")
    assert set(files) == {"pergrad/v1/gradient_service.proto", "pergrad/v1/tensor.proto"}
    for path, declaration in [
        ("pergrad/v1/tensor.proto", "message TensorChunk"),
        ("pergrad/v1/gradient_service.proto", "enum Reduction"),
        ("pergrad/v1/gradient_service.proto", "rpc StreamPerExampleGradients"),
    ]:
        assert " ".join(_proto_comment_before(path, declaration).split()) in _comments(files[path])


def test_other_services_are_still_described(server: RunningServer) -> None:
    files = _files(server, "grpc.health.v1.Health")
    assert "grpc_health/v1/health.proto" in files


def _listed(port: int) -> set[str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (reply,) = stub.ServerReflectionInfo(iter([request]), timeout=10)
    return {s.name for s in reply.list_services_response.service}


def test_reflection_lists_the_services_its_port_serves(server: RunningServer) -> None:
    assert _listed(server.port) == {SERVICE, HEALTH, REFLECTION}


def test_on_a_port_of_their_own_reflection_lists_only_the_open_services() -> None:
    """--open-services-port: that port serves health and reflection alone, and its
    reflection lists just those (before: GradientService too, which answers UNIMPLEMENTED
    there); it still describes the service's file by name."""
    running = start(loopback_config("mnist_mlp", open_services_port=0))
    try:
        assert _listed(running.open_port) == {HEALTH, REFLECTION}
        channel = grpc.insecure_channel(f"127.0.0.1:{running.open_port}")
        with channel, pytest.raises(grpc.RpcError) as err:
            channel.unary_unary(f"/{SERVICE}/ListModels")(b"", timeout=10)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        files = _files(running, SERVICE, running.open_port)
        assert "pergrad/v1/gradient_service.proto" in files
    finally:
        running.stop(0)
