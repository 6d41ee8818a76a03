"""Building GradientsRequests: numpy inputs cast to the model's dtypes, reduction options."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from pergrad.client._codec import encode_tensor
from pergrad.client._types import ModelInfo, PergradError, TensorInfo
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2 as pb_tensor

_SCALAR_OPTIONS = ("max_norm", "noise_multiplier", "seed", "dim")
WIRE_DTYPES = {
    "float32": pb_tensor.DATA_TYPE_FLOAT32,
    "float16": pb_tensor.DATA_TYPE_FLOAT16,
    "bfloat16": pb_tensor.DATA_TYPE_BFLOAT16,
}


def _invalid(message: str) -> PergradError:
    return PergradError(grpc.StatusCode.INVALID_ARGUMENT, message)


def cast(array: Any, spec: TensorInfo, *, what: str) -> np.ndarray:
    """`array` in the dtype the model expects, refusing lossy kinds of conversion."""
    array = np.asarray(array)
    if array.dtype == spec.dtype:
        return np.ascontiguousarray(array)
    if not np.can_cast(array.dtype, spec.dtype, casting="same_kind"):
        raise _invalid(f"{what}: model expects {spec.dtype.name}, got {array.dtype.name}")
    if np.issubdtype(spec.dtype, np.integer) and array.size:
        limits = np.iinfo(spec.dtype)
        if array.min() < limits.min or array.max() > limits.max:
            raise _invalid(f"{what}: values outside the range of {spec.dtype.name}")
    return np.ascontiguousarray(array, dtype=spec.dtype)


def _reduction_fields(
    reduction: str, variables: Sequence[str] | None, options: Mapping[str, Any]
) -> dict[str, Any]:
    try:
        fields: dict[str, Any] = {"reduction": pb.Reduction.Value(f"REDUCTION_{reduction.upper()}")}
    except ValueError:
        known = [n.removeprefix("REDUCTION_").lower() for n in pb.Reduction.keys()]  # noqa: SIM118 - an enum wrapper, not a dict
        raise _invalid(f"reduction: unknown {reduction!r}; known: {', '.join(known)}") from None
    if variables is not None:
        fields["variables"] = list(variables)
    options = dict(options)
    for name in _SCALAR_OPTIONS:
        if name in options:
            fields[name] = options.pop(name)
    if "kind" in options:
        kind = str(options.pop("kind"))
        try:
            fields["projection"] = pb.ProjectionKind.Value(f"PROJECTION_KIND_{kind.upper()}")
        except ValueError:
            raise _invalid(f"kind: unknown projection {kind!r}") from None
    if "reference" in options:
        fields["reference"] = {
            name: encode_tensor(np.asarray(value, np.float32))
            for name, value in options.pop("reference").items()
        }
    if options:
        raise _invalid(f"unknown options {sorted(options)}")
    return fields


def gradients_request(
    info: ModelInfo,
    x: Any,
    y: Any,
    *,
    model_version: int,
    reduction: str,
    variables: Sequence[str] | None,
    options: Mapping[str, Any],
    wire_dtype: str | None = None,
    request_id: int = 0,
) -> pb.GradientsRequest:
    if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
        raise _invalid(f"wire_dtype: {wire_dtype!r} is not one of {sorted(WIRE_DTYPES)}")
    return pb.GradientsRequest(
        model=info.name,
        model_version=model_version,
        inputs=encode_tensor(cast(x, info.input, what="inputs")),
        labels=encode_tensor(cast(y, info.labels, what="labels")),
        request_id=request_id,
        wire_dtype=WIRE_DTYPES.get(wire_dtype or "", pb_tensor.DATA_TYPE_UNSPECIFIED),
        **_reduction_fields(reduction, variables, options),
    )
