"""One gradients request, from the parsed request to the response messages.

The request is parsed and its batch checked once, before admission; admission prices
what the result will hold (`expected_outputs`, by the catalogue); then full gradients
stream block by block while the next block computes, reductions are computed whole and
then chunked (or, at most one chunk asked `inline_result`, sent in the header), and small
requests share passes with others (`pergrad.server.coalescer`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial

import numpy as np

from pergrad.server.admission.inflight import Admission
from pergrad.server.coalescer import Coalescer
from pergrad.server.config import Config
from pergrad.server.engine import Batch
from pergrad.server.engine.group import Job
from pergrad.server.engine.sinks import Sink
from pergrad.server.errors import FailedPrecondition, InvalidArgument, over_max_batch
from pergrad.server.memory import in_flight
from pergrad.server.models.registry import ServedModel
from pergrad.server.prefetch import prefetched
from pergrad.server.sharing import UNRESOLVED_COALESCING, served_plan
from pergrad.server.weights import Snapshot
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2
from pergrad.wire.casting import dtype_named
from pergrad.wire.catalogue import NONE
from pergrad.wire.chunked_requests import Key, Whole, tensor_name
from pergrad.wire.chunks import RawChunk, encode_chunk
from pergrad.wire.codec import iter_raw_chunks, wire_bytes
from pergrad.wire.messages import Asked, parse_request, result_arrays, result_header
from pergrad.wire.results import ExpectedOutput, GradientResult, expected_outputs
from pergrad.wire.terms import CheckedOptions
from pergrad.wire.text import quoted

Part = pb.ResultHeader | RawChunk
_GRADIENTS = "gradients"  # full gradients' output field (`wire.catalogue`)


@dataclass(frozen=True)
class Settings:
    """The server's settings a gradients request needs (`of`: from its configuration)."""

    max_batch: int
    chunk_bytes: int
    replica_name: str
    max_coalesced_batch: int

    @classmethod
    def of(cls, config: Config) -> Settings:
        if (bound := config.max_coalesced_batch) is None:
            raise ValueError(UNRESOLVED_COALESCING)
        return cls(config.max_batch, config.chunk_bytes, config.replica_name, bound)


@dataclass(frozen=True)
class Work:
    """A request, parsed and checked, ready to be admitted and computed."""

    served: ServedModel
    asked: Asked
    batch: Batch
    snapshot: Snapshot
    outputs: list[tuple[ExpectedOutput, np.dtype]]
    inline: bool = False  # the request takes a small result in its header

    @property
    def result_bytes(self) -> int:
        return sum(int(np.prod(e.shape)) * dtype.itemsize for e, dtype in self.outputs)

    @property
    def wire(self) -> np.dtype | None:
        """The gradients' dtype on the wire the request asked for (None: their own)."""
        name = self.asked.options.get("wire_dtype")
        return dtype_named(name) if name else None


def _decode(request: Whole, tensor: tensor_pb2.Tensor, key: Key, max_batch: int) -> np.ndarray:
    """The tensor's array (`Whole.array`), its batch size checked before anything else."""
    if tensor.shape and tensor.shape[0] > max_batch:
        raise over_max_batch(tensor_name(key), tensor.shape[0], max_batch)
    return request.array(tensor, key)


def _decode_batch(
    request: Whole, max_batch: int
) -> tuple[np.ndarray | dict[str, np.ndarray], np.ndarray]:
    """Inputs (one array, or one per input name) and labels, viewing the request's bytes
    (or the arrays its chunks were read into)."""
    message = request.message
    if message.named_inputs and message.HasField("inputs"):
        raise InvalidArgument("inputs: set `inputs` or `named_inputs`, not both")
    if not message.named_inputs and not message.HasField("inputs"):
        raise InvalidArgument("inputs: missing")
    if not message.HasField("labels"):
        raise InvalidArgument("labels: missing")
    x: np.ndarray | dict[str, np.ndarray]
    if message.named_inputs:
        x = {
            name: _decode(request, tensor, ("named_inputs", name), max_batch)
            for name, tensor in message.named_inputs.items()
        }
    else:
        x = _decode(request, message.inputs, ("inputs", None), max_batch)
    return x, _decode(request, message.labels, ("labels", None), max_batch)


def prepare(served: ServedModel, request: Whole, settings: Settings) -> Work:
    """Everything about `request` that can be refused, refused before any work."""
    asked = parse_request(request)
    engine = served.engine
    batch = engine.batch(*_decode_batch(request, settings.max_batch), cast_dtypes=False)
    message = request.message
    snapshot = served.weights.get(message.model_version, message.weights_id)
    selected = engine.passes.select(asked.variables)
    expected = expected_outputs(
        asked.reduction,
        batch=batch.size,
        variables=[(v.name, v.shape) for v in selected],
        options=asked.options,
    )
    variables = {v.name: v.dtype for v in selected}
    wire = asked.options.get("wire_dtype")
    outputs = [(e, e.dtype(variables, wire, engine.loss_dtype)) for e in expected]
    return Work(served, asked, batch, snapshot, outputs, message.inline_result)


@dataclass(frozen=True)
class Charge:
    """What one call's work is charged to and stopped by: the server's admission, the
    call's caller and the bytes it holds already (its message's, held from its arrival),
    and whether the call has ended."""

    admission: Admission
    cancelled: Callable[[], bool]
    caller: str = ""
    held_bytes: int = 0

    def admit(self, work: Work) -> AbstractContextManager[None]:
        """Hold `work`'s examples and result bytes while it computes, or refuse at once."""
        return self.admission.admit(
            work.batch.size, work.result_bytes, self.caller, self.held_bytes
        )


def responses(
    work: Work,
    request_id: int,
    settings: Settings,
    charge: Charge,
    coalescer: Coalescer | None = None,
) -> Iterator[pb.GradientsResponse | bytes]:
    """The response messages of `work`: a header, then pre-encoded chunk messages. A small
    request shares passes with others (`coalescer`, fairly between callers); a larger one
    streams full gradients block by block, or computes its reduction alone."""
    cancelled = charge.cancelled
    with charge.admit(work), in_flight():
        if coalescer is not None and coalescer.takes(work.batch.size):
            shared = partial(_shared, work, coalescer, cancelled, charge.caller)
            parts = _whole_result(work, settings, shared)
        elif work.asked.reduction.name == NONE:
            parts = _full_gradients(work, settings, cancelled)
        else:
            parts = _whole_result(work, settings, lambda: _alone(work, cancelled))
        for part in parts:
            if isinstance(part, pb.ResultHeader):
                yield pb.GradientsResponse(request_id=request_id, header=part)
            else:
                yield encode_chunk(request_id, *part)


def reduced(work: Work, charge: Charge) -> GradientResult:
    """`work`'s reduction alone, admitted like a request's, its values finite (ApplyStep's)."""
    with charge.admit(work), in_flight():
        result = _alone(work, charge.cancelled)
    _finite([array for _, _, array in result_arrays(result)])
    return result


def _header(work: Work, settings: Settings, outputs: Sequence) -> pb.ResultHeader:
    return result_header(
        model=work.served.name,
        model_version=work.snapshot.version,
        weights_id=work.snapshot.weights_id,
        batch_size=work.batch.size,
        server=settings.replica_name,
        outputs=outputs,
        plan_id=served_plan(work.served.engine, settings.max_coalesced_batch)[1],
    )


def _sink(work: Work) -> Sink:
    """The request's sink; its options were checked as the request was parsed. Full
    gradients stay in their variables' dtypes there: `_on_wire` casts them to the wire's."""
    asked = work.asked
    options = asked.options
    if "wire_dtype" in options:
        options = CheckedOptions(options.reduction, {**options, "wire_dtype": None})
    return work.served.engine.passes.checked_sink(
        work.batch.size, asked.reduction, options, variables=asked.variables
    )


def _alone(work: Work, cancelled: Callable[[], bool]) -> GradientResult:
    engine = work.served.engine
    return engine.passes.run(
        work.batch, _sink(work), trainable=work.snapshot.trainable, cancelled=cancelled
    )


def _shared(
    work: Work, coalescer: Coalescer, cancelled: Callable[[], bool], caller: str
) -> GradientResult:
    return coalescer.compute(Job(work.batch, _sink(work), cancelled), work.snapshot, caller)


def _finite(arrays: Sequence[np.ndarray]) -> None:
    """Inputs are finite (checked), so a NaN or infinity in a result comes from weights whose
    use overflows float32: refused, never sent as if it were a result."""
    for array in arrays:
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise FailedPrecondition(
                "the result holds NaN or infinity: the current weights overflow on this "
                "batch; set smaller weights"
            )


def _on_wire(array: np.ndarray, dtype: np.dtype, variable: str) -> np.ndarray:
    """A variable's gradients (finite: `_finite` checked them) in the dtype the request
    asked for on the wire. One that would round to infinity there (FLOAT16 from 65520,
    BFLOAT16 from (2 - 2^-8) * 2^127) is refused, never sent as infinity."""
    if array.dtype == dtype:
        return array
    with np.errstate(over="ignore"):
        cast = array.astype(dtype)
    if not np.isfinite(cast).all():
        instead = "FLOAT32 or BFLOAT16" if dtype == np.float16 else "FLOAT32"
        raise FailedPrecondition(
            f"gradients[{quoted(variable)}]: a value of magnitude "
            f"{float(np.abs(array).max()):.7g} overflows {dtype.name} on the wire (largest "
            f"{float(np.finfo(dtype).max):.7g}); ask for wire_dtype {instead}, or scale the "
            "loss down"
        )
    return cast


def _whole_result(
    work: Work, settings: Settings, compute: Callable[[], GradientResult]
) -> Iterator[Part]:
    tensors = result_arrays(compute())
    _finite([array for _, _, array in tensors])
    if work.wire is not None:
        tensors = [
            (f, v, _on_wire(a, work.wire, v) if f == _GRADIENTS else a) for f, v, a in tensors
        ]
    header = _header(work, settings, [(f, v, a.shape, a.dtype) for f, v, a in tensors])
    if work.inline and sum(a.nbytes for _, _, a in tensors) <= settings.chunk_bytes:
        header.data = b"".join(wire_bytes(array) for _, _, array in tensors)
        yield header
        return
    yield header
    for index, (_, _, array) in enumerate(tensors):
        yield from iter_raw_chunks(index, array, chunk_bytes=settings.chunk_bytes)


def _full_gradients(
    work: Work, settings: Settings, cancelled: Callable[[], bool]
) -> Iterator[Part]:
    """Full per-example gradients, streamed block by block: a thread computes block k+1
    while block k is serialized and sent, the engine rotating three sets of block buffers
    (one being sent, one waiting, one being filled)."""
    yield _header(work, settings, [(e.field, e.variable, e.shape, d) for e, d in work.outputs])
    blocks = work.served.engine.passes.blocks(
        work.batch,
        variables=work.asked.variables,
        trainable=work.snapshot.trainable,
        buffer_sets=3,
    )
    gradients = [(expected.variable, dtype) for expected, dtype in work.outputs[1:]]

    def casted() -> Iterator[tuple[int, list[np.ndarray]]]:
        """Each block checked, then cast to the wire dtype (whose rounding the contract
        states; an overflow is refused), in the prefetch thread, beside the sending."""
        for part in blocks:
            _finite([part.losses, *part.gradients])
            cast = [_on_wire(g, d, v) for g, (v, d) in zip(part.gradients, gradients, strict=True)]
            yield part.start, [part.losses, *cast]

    for first, arrays in prefetched(casted(), stop=cancelled):
        for index, array in enumerate(arrays):
            start = first * (array.nbytes // array.shape[0])
            yield from iter_raw_chunks(index, array, start=start, chunk_bytes=settings.chunk_bytes)
