"""The service's name and method paths, from the generated descriptor; the methods whose
one request may come in chunks; the services a pergrad server also serves to any caller;
and the split of a full method path."""

from __future__ import annotations

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


def streaming(path: str) -> tuple[bool, bool] | None:
    """Whether the requests and the responses of the GradientService method at `path`
    stream; None for a path that is not one of its methods."""
    service, name = split_method(path)
    method = SERVICE.methods_by_name.get(name) if service == SERVICE_NAME else None
    return None if method is None else (method.client_streaming, method.server_streaming)


def split_method(path: str) -> tuple[str, str]:
    """("pergrad.v1.GradientService", "ListModels") of "/pergrad.v1.GradientService/ListModels";
    the service is "" for a path without one."""
    service, _, method = path.lstrip("/").rpartition("/")
    return service, method
