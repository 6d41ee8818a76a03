"""Server reflection serves the wire contract with the comments its .proto files hold."""

from __future__ import annotations

import re

import grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pergrad.server.main import RunningServer
from tests.conftest import ROOT

PROTOS = ROOT / "protos"


def _files(server: RunningServer, symbol: str) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
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
