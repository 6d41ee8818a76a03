"""What a GradientsRequest asks the engine for: the reduction, its options, the variables.

Only fields the caller set become options, so the engine can refuse an option that
the chosen reduction does not take instead of ignoring it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pergrad.client._codec import decode_tensor
from pergrad.server.errors import InvalidArgument
from pergrad.v1 import gradient_service_pb2 as pb

_PREFIX = "REDUCTION_"
_KIND_PREFIX = "PROJECTION_KIND_"


@dataclass(frozen=True)
class ReductionRequest:
    name: str
    variables: list[str] | None
    options: dict[str, Any] = field(default_factory=dict)


def _enum_name(enum: Any, value: int, field: str) -> str:
    if value not in enum.values():
        raise InvalidArgument(f"{field}: unknown value {value}; known: {', '.join(enum.keys())}")
    return enum.Name(value)


def reduction_request(request: pb.GradientsRequest) -> ReductionRequest:
    """The engine's reduction name ("none", "norms", ...), variables filter and options."""
    options: dict[str, Any] = {}
    for name in ("max_norm", "noise_multiplier", "seed", "dim"):
        if request.HasField(name):
            options[name] = getattr(request, name)
    if request.HasField("projection"):
        kind = _enum_name(pb.ProjectionKind, request.projection, "projection")
        options["kind"] = kind.removeprefix(_KIND_PREFIX).lower()
    if request.reference:
        options["reference"] = {
            name: decode_tensor(tensor, what=f"reference[{name!r}]")
            for name, tensor in request.reference.items()
        }
    name = _enum_name(pb.Reduction, request.reduction, "reduction").removeprefix(_PREFIX).lower()
    return ReductionRequest(name, list(request.variables) or None, options)
