"""The result layout on the wire: which output tensors a ResultHeader lists, and back.

Both sides use this module, so the field names exist once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc
import numpy as np

from pergrad.client._codec import CodecError, TensorAssembler, tensor_spec, wire_dtype
from pergrad.client._types import GradientResult, PergradError
from pergrad.client._wire import decode_response
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2

LOSSES = "losses"
GRADIENTS = "gradients"
# GradientResult fields that map variable names to tensors; the others are one tensor.
PER_VARIABLE = ("gradients", "variable_norms", "clipped_sum", "sum", "sum_squares")
SINGLE = ("losses", "norms", "num_clipped", "dots", "projections")


def header_for_shapes(
    *,
    model: str,
    model_version: int,
    batch_size: int,
    loss_dtype: np.dtype,
    variables: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
) -> pb.ResultHeader:
    """Header announced before computing: losses [B], then one [B, *shape] per variable."""
    outputs = [
        pb.ResultTensor(
            field=LOSSES,
            tensor=tensor_pb2.TensorSpec(dtype=wire_dtype(loss_dtype), shape=[batch_size]),
        )
    ]
    outputs += [
        pb.ResultTensor(
            field=GRADIENTS,
            tensor=tensor_pb2.TensorSpec(
                name=name, dtype=wire_dtype(dtype), shape=[batch_size, *shape]
            ),
        )
        for name, dtype, shape in variables
    ]
    return pb.ResultHeader(
        model=model, model_version=model_version, batch_size=batch_size, outputs=outputs
    )


def result_outputs(result: GradientResult) -> tuple[list[pb.ResultTensor], list[np.ndarray]]:
    """Every tensor a (reduced) result holds, with its ResultTensor, in a fixed order."""
    outputs, arrays = [], []
    for name in SINGLE:
        value = getattr(result, name)
        if value is not None:
            arrays.append(np.asarray(value))
            outputs.append(pb.ResultTensor(field=name, tensor=tensor_spec("", arrays[-1])))
    for name in PER_VARIABLE:
        for variable, value in getattr(result, name).items():
            arrays.append(np.asarray(value))
            outputs.append(pb.ResultTensor(field=name, tensor=tensor_spec(variable, arrays[-1])))
    return outputs, arrays


def result_from_arrays(header: pb.ResultHeader, arrays: Sequence[np.ndarray]) -> GradientResult:
    fields: dict[str, object] = {name: {} for name in PER_VARIABLE}
    for output, array in zip(header.outputs, arrays, strict=True):
        if output.field in PER_VARIABLE:
            fields[output.field][output.tensor.name] = array
        elif output.field == "num_clipped":
            fields[output.field] = int(array)
        elif output.field in SINGLE:
            fields[output.field] = array
        else:
            raise PergradError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"server sent output field {output.field!r}, unknown to this client; upgrade it",
            )
    if "losses" not in fields:
        raise PergradError(grpc.StatusCode.INTERNAL, "server sent a result without losses")
    return GradientResult(
        model_version=header.model_version, model=header.model, server=header.server, **fields
    )


def _arrays_of(result: GradientResult, header: pb.ResultHeader) -> list[np.ndarray]:
    """The arrays of `result` in the order the header lists its outputs."""
    arrays = []
    for output in header.outputs:
        value = getattr(result, output.field, None)
        if output.field in PER_VARIABLE:
            value = value.get(output.tensor.name)
        if not isinstance(value, np.ndarray):
            raise CodecError(f"out= has no array for {output.field} {output.tensor.name!r}")
        arrays.append(value)
    return arrays


def read_results(
    responses: Iterator[bytes], *, out: GradientResult | None = None
) -> Iterator[tuple[int, GradientResult]]:
    """(request_id, result) for each complete result in a stream of serialized
    GradientsResponses (see `_wire`), in order; `out`'s arrays are refilled if given."""
    header: pb.ResultHeader | None = None
    assembler: TensorAssembler | None = None
    request_id = 0
    try:
        for message in responses:
            part = decode_response(message)
            if part.header is not None:
                if assembler is not None:
                    raise CodecError(f"result {request_id} ended before all its bytes arrived")
                header, request_id = part.header, part.request_id
                into = _arrays_of(out, header) if out is not None else None
                assembler = TensorAssembler([o.tensor for o in header.outputs], into=into)
            elif assembler is None or part.chunk is None or part.request_id != request_id:
                raise CodecError("chunk without a header for its request")
            else:
                assembler.add_raw(*part.chunk)
            if assembler is not None and assembler.complete:
                yield request_id, result_from_arrays(header, assembler.arrays())
                assembler = None
        if assembler is not None:
            raise CodecError(f"stream ended inside result {request_id}")
    except (CodecError, ValueError) as err:
        raise PergradError(grpc.StatusCode.DATA_LOSS, str(err)) from None
