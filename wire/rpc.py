"""The service's name and method paths, from the generated descriptor; the methods whose
one request may come in chunks; the services a pergrad server also serves to any caller;
each method's kind, as a server registers it; and the split of a full method path."""

from __future__ import annotations

from google.protobuf import descriptor_pool
from google.protobuf.descriptor import MethodDescriptor

from pergrad.v1 import gradient_service_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["GradientService"]
SERVICE_NAME = SERVICE.full_name

# Served beside GradientService to any caller, with or without a token: probes and tooling
# that only describe the server (grpc.health.v1, and reflection in both its versions).
OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)


# Methods that take one request, request-streaming in the proto only so that the request
# can come in chunks (its message, then its chunks: "Chunked requests"): a server admits
# and prices each call as a call of one request.
ONE_REQUEST_IN_CHUNKS = frozenset({"ComputePerExampleGradients", "ApplyStep"})


def method_path(name: str) -> str:
    """ "/pergrad.v1.GradientService/<name>" for a method the service has."""
    return f"/{SERVICE_NAME}/{SERVICE.methods_by_name[name].name}"


def registered(method: MethodDescriptor) -> tuple[bool, bool]:
    """Whether the method's requests and responses stream, as a server registers it: a
    method whose one request may come in chunks takes one."""
    service = method.containing_service.full_name
    one = service == SERVICE_NAME and method.name in ONE_REQUEST_IN_CHUNKS
    return method.client_streaming and not one, method.server_streaming


def streaming(path: str) -> tuple[bool, bool] | None:
    """`registered` for the method at `path`, from its descriptor (any service whose
    protos are imported: pergrad's, health, reflection); None for a path that names no
    such method."""
    service, name = split_method(path)
    try:
        return registered(descriptor_pool.Default().FindMethodByName(f"{service}.{name}"))
    except KeyError:
        return None


def split_method(path: str) -> tuple[str, str]:
    """("pergrad.v1.GradientService", "ListModels") of "/pergrad.v1.GradientService/ListModels";
    the service is "" for a path without one."""
    service, _, method = path.lstrip("/").rpartition("/")
    return service, method
