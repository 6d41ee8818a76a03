"""Server reflection that serves pergrad's wire contract with its comments.

grpcio-reflection serves file descriptors from the generated code, which protoc writes
without comments; a user of grpcurl then sees message shapes but none of the rules the
.proto files state. `make protos` also writes `pergrad/v1/descriptors.binpb`, the same
files with their source info (comments); this servicer answers with those for pergrad's
files and as grpcio-reflection does for every other file (health, reflection itself).
"""

from __future__ import annotations

from importlib import resources

import grpc
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

SERVICE_NAME = reflection.SERVICE_NAME


class DocumentedReflection(reflection.ReflectionServicer):
    def __init__(self, service_names: list[str]) -> None:
        super().__init__(service_names)
        data = resources.files("pergrad.v1").joinpath("descriptors.binpb").read_bytes()
        files = descriptor_pb2.FileDescriptorSet.FromString(data).file
        self._documented = {f.name: f.SerializeToString() for f in files}

    def _file_by_filename(self, request, filename):
        try:
            descriptor = self._pool.FindFileByName(filename)
        except KeyError:
            return super()._file_by_filename(request, filename)
        return self._response(descriptor, request)

    def _file_containing_symbol(self, request, fully_qualified_name):
        try:
            descriptor = self._pool.FindFileContainingSymbol(fully_qualified_name)
        except KeyError:
            return super()._file_containing_symbol(request, fully_qualified_name)
        return self._response(descriptor, request)

    def _response(
        self, descriptor: FileDescriptor, request: reflection_pb2.ServerReflectionRequest
    ) -> reflection_pb2.ServerReflectionResponse:
        """The file and every file it imports, documented where pergrad has them."""
        files: dict[str, FileDescriptor] = {}
        pending = [descriptor]
        while pending:
            current = pending.pop()
            if current.name not in files:
                files[current.name] = current
                pending.extend(current.dependencies)
        return reflection_pb2.ServerReflectionResponse(
            file_descriptor_response=reflection_pb2.FileDescriptorResponse(
                file_descriptor_proto=[
                    self._documented.get(name) or _serialized(file) for name, file in files.items()
                ]
            ),
            original_request=request,
        )


def _serialized(file: FileDescriptor) -> bytes:
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)
    return proto.SerializeToString()


def add_reflection(service_names: list[str], server: grpc.Server) -> None:
    """Reflection for `service_names` (and itself), pergrad's files with their comments."""
    servicer = DocumentedReflection([*service_names, SERVICE_NAME])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
