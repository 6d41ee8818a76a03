"""Reading results off a stream of serialized GradientsResponses, trusting nothing.

Every header is checked against what the request implies (`Call.expected`: the fields,
variables, shapes and dtypes of a correct result) before a byte is allocated, so a server
that answers another batch size, another reduction or a 2 GiB tensor is refused with
DATA_LOSS instead of being believed. Chunks fill the arrays in place (`TensorAssembler`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from pergrad.client._types import answer_checked
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.chunks import decode_response
from pergrad.wire.codec import CodecError, TensorAssembler, numpy_dtype
from pergrad.wire.messages import result_from_arrays
from pergrad.wire.results import ExpectedOutput, GradientResult

# The outputs a request's result must hold, by request_id: (output, dtype or None for any
# floating-point type).
Expect = Callable[[int], Sequence[tuple[ExpectedOutput, np.dtype | None]]]


def check_header(
    header: pb.ResultHeader, expected: Sequence[tuple[ExpectedOutput, np.dtype | None]]
) -> None:
    """CodecError unless `header` announces exactly the `expected` outputs."""
    batch = expected[0][0].shape[0]
    if header.batch_size != batch:
        raise CodecError(f"result for {header.batch_size} examples, the request sent {batch}")
    got = [(o.field, o.tensor.name, tuple(o.tensor.shape)) for o in header.outputs]
    want = [(e.field, e.variable, e.shape) for e, _ in expected]
    if got != want:
        extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
        raise CodecError(f"result does not fit the request: unexpected {extra}, missing {missing}")
    for output, (want_output, dtype) in zip(header.outputs, expected, strict=True):
        got_dtype = numpy_dtype(output.tensor.dtype)
        if (dtype is None and got_dtype.kind != "f") or (dtype is not None and got_dtype != dtype):
            raise CodecError(f"{want_output.field} {output.tensor.name!r}: dtype {got_dtype.name}")


def _arrays_of(result: GradientResult, header: pb.ResultHeader) -> list[np.ndarray]:
    """The arrays of `result` in the order the header lists its outputs (for out=)."""
    arrays = []
    for output in header.outputs:
        field, name = output.field, output.tensor.name
        value = result.losses if field == "losses" else result.outputs.get(field)
        if isinstance(value, dict):
            value = value.get(name)
        if not isinstance(value, np.ndarray):
            raise CodecError(f"out= has no array for {field} {name!r}")
        arrays.append(value)
    return arrays


def read_results(
    responses: Iterator[bytes], expect: Expect, *, out: GradientResult | None = None
) -> Iterator[tuple[int, GradientResult]]:
    """(request_id, result) for each complete result, in order; `out`'s arrays are
    refilled if given. Any fault of the stream is a PergradError with DATA_LOSS."""
    current: tuple[pb.ResultHeader, TensorAssembler] | None = None  # a result under way
    request_id = 0
    with answer_checked(""):
        for message in responses:
            part = decode_response(message)
            if part.header is not None:
                if current is not None:
                    raise CodecError(f"result {request_id} ended before all its bytes arrived")
                header, request_id = part.header, part.request_id
                check_header(header, expect(request_id))
                into = _arrays_of(out, header) if out is not None else None
                current = header, TensorAssembler([o.tensor for o in header.outputs], into=into)
                if header.data:
                    current[1].add_inline(header.data)
            elif current is None or part.chunk is None or part.request_id != request_id:
                raise CodecError("chunk without a header for its request")
            else:
                current[1].add_raw(*part.chunk)
            if current is not None and current[1].complete:
                yield request_id, result_from_arrays(current[0], current[1].arrays())
                current = None
        if current is not None:
            raise CodecError(f"stream ended inside result {request_id}")
