"""The service's name and method paths, from the generated descriptor."""

from __future__ import annotations

from pergrad.v1 import gradient_service_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["GradientService"]
SERVICE_NAME = SERVICE.full_name


def method_path(name: str) -> str:
    """"/pergrad.v1.GradientService/<name>" for a method the service has."""
    return f"/{SERVICE_NAME}/{SERVICE.methods_by_name[name].name}"
