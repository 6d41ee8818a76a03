"""The gRPC servicer: validate, call the engine, stream the result in chunks.

Every method is wrapped by `_status`, the one place where errors become gRPC status
codes; nothing else aborts a call.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError, Message

from pergrad.client import GradientResult
from pergrad.client._codec import (
    CodecError,
    TensorAssembler,
    decode_tensor,
    iter_chunks,
    iter_raw_chunks,
    numpy_dtype,
    tensor_spec,
    wire_dtype,
)
from pergrad.client._results import header_for_shapes, result_outputs
from pergrad.client._wire import RawChunk, encode_chunk, serialize
from pergrad.server.admission import Admission
from pergrad.server.config import Config
from pergrad.server.engine import reductions
from pergrad.server.errors import InvalidArgument, PergradServerError
from pergrad.server.metrics import ServerMetrics
from pergrad.server.models.registry import ModelRegistry, ServedModel
from pergrad.server.prefetch import prefetched
from pergrad.server.reduction_request import reduction_request
from pergrad.server.weights import Snapshot
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import gradient_service_pb2_grpc as pb_grpc
from pergrad.v1 import tensor_pb2

_LOGGER = logging.getLogger(__name__)
_WIRE_FLOATS = (
    tensor_pb2.DATA_TYPE_FLOAT32,
    tensor_pb2.DATA_TYPE_FLOAT16,
    tensor_pb2.DATA_TYPE_BFLOAT16,
    tensor_pb2.DATA_TYPE_FLOAT64,
)


def _abort(context: grpc.ServicerContext, err: Exception, metrics: ServerMetrics) -> None:
    if isinstance(err, PergradServerError):
        code, message = grpc.StatusCode[err.code], str(err)
    elif isinstance(err, CodecError):
        code, message = grpc.StatusCode.INVALID_ARGUMENT, str(err)
    else:
        _LOGGER.exception("internal error")
        code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}"
    metrics.request_rejected(code)
    context.abort(code, message)


def _well_formed(request: Any) -> Any:
    """The request, or each request of a stream, refused if its bytes did not parse."""
    if isinstance(request, MalformedRequest):
        raise InvalidArgument(request.error)
    if isinstance(request, Message):
        return request
    return (_well_formed(item) for item in request)


def _status(method: Callable[..., Any]) -> Callable[..., Any]:
    """Map pergrad and codec errors to their status codes, anything else to INTERNAL."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def streaming(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from method(self, _well_formed(request), context)
            except Exception as err:
                _abort(context, err, self._metrics)

        return streaming

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, _well_formed(request), context)
        except Exception as err:
            _abort(context, err, self._metrics)

    return unary


def _batched_spec(
    name: str, dtype: np.dtype, shape: tuple[int | None, ...]
) -> tensor_pb2.TensorSpec:
    """Spec with -1 for the batch and for any per-example dimension of free size."""
    dims = [-1, *(-1 if d is None else d for d in shape)]
    return tensor_pb2.TensorSpec(name=name, dtype=wire_dtype(dtype), shape=dims)


class GradientServicer(pb_grpc.GradientServiceServicer):
    def __init__(
        self, registry: ModelRegistry, config: Config, metrics: ServerMetrics | None = None
    ) -> None:
        self._registry = registry
        self._config = config
        self._metrics = metrics if metrics is not None else ServerMetrics()
        self._admission = Admission(
            max_examples=config.max_inflight_examples, max_bytes=config.max_inflight_bytes
        )

    @_status
    def ListModels(self, request: pb.ListModelsRequest, context: Any) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=self._registry.names)

    @_status
    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Any) -> pb.ModelInfo:
        served = self._registry.get(request.model)
        engine = served.engine
        return pb.ModelInfo(
            name=served.name,
            model_version=served.weights.current.version,
            variables=[
                tensor_pb2.TensorSpec(name=v.name, dtype=wire_dtype(v.dtype), shape=v.shape)
                for v in engine.variables
            ],
            input=_batched_spec("input", engine.input_spec.dtype, engine.input_spec.shape),
            labels=_batched_spec("labels", engine.label_spec.dtype, engine.label_spec.shape),
            loss=engine.loss.description,
            num_classes=engine.label_spec.num_classes,
            server=self._config.replica_name,
        )

    @_status
    def GetWeights(
        self, request: pb.GetWeightsRequest, context: Any
    ) -> Iterator[pb.WeightsMessage]:
        served = self._registry.get(request.model)
        snapshot = served.weights.current
        arrays = served.weights.arrays(snapshot)
        specs = [tensor_spec(name, array) for name, array in arrays.items()]
        yield pb.WeightsMessage(
            header=pb.WeightsHeader(
                model=served.name, model_version=snapshot.version, tensors=specs
            )
        )
        for index, array in enumerate(arrays.values()):
            for chunk in iter_chunks(index, array, chunk_bytes=self._config.chunk_bytes):
                yield pb.WeightsMessage(chunk=chunk)

    @_status
    def SetWeights(
        self, request_iterator: Iterator[pb.WeightsMessage], context: Any
    ) -> pb.SetWeightsResponse:
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            raise InvalidArgument("SetWeights: the first message must be a WeightsHeader")
        header = first.header
        served = self._registry.get(header.model)
        with self._metrics.weights_update(served.name) as update:
            served.weights.check(
                [(t.name, numpy_dtype(t.dtype), tuple(t.shape)) for t in header.tensors]
            )
            assembler = TensorAssembler(header.tensors)
            for message in request_iterator:
                if not message.HasField("chunk"):
                    raise InvalidArgument("SetWeights: one header first, then only chunks")
                assembler.add(message.chunk)
            arrays = dict(zip((t.name for t in header.tensors), assembler.arrays(), strict=True))
            version = served.weights.replace(
                arrays, expected_version=header.model_version, new_version=header.new_version
            )
            update.succeeded(version)
        _LOGGER.info("model %s: weights version %d", served.name, version)
        return pb.SetWeightsResponse(model=served.name, model_version=version)

    @_status
    def ComputePerExampleGradients(
        self, request: pb.GradientsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GradientsResponse]:
        yield from self._metrics.gradients(request, self._gradients(request, context), context)

    @_status
    def StreamPerExampleGradients(
        self, request_iterator: Iterator[pb.GradientsRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.GradientsResponse]:
        for request in request_iterator:
            try:
                responses = self._gradients(request, context)
                yield from self._metrics.gradients(request, responses, context)
            except PergradServerError as err:
                raise type(err)(f"request {request.request_id}: {err}") from err

    def _decode_batch(self, request: pb.GradientsRequest) -> tuple[np.ndarray, np.ndarray]:
        """Inputs and labels as arrays viewing the request's bytes, sizes checked first."""
        tensors = {"inputs": request.inputs, "labels": request.labels}
        for field, tensor in tensors.items():
            if not request.HasField(field):
                raise InvalidArgument(f"{field}: missing")
            if tensor.shape and tensor.shape[0] > self._config.max_batch:
                raise InvalidArgument(
                    f"{field}: batch of {tensor.shape[0]} exceeds --max-batch "
                    f"{self._config.max_batch}; split it"
                )
        x, y = (decode_tensor(tensor, what=field) for field, tensor in tensors.items())
        return x, y

    def _gradients(
        self, request: pb.GradientsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GradientsResponse]:
        served = self._registry.get(request.model)
        x, y = self._decode_batch(request)
        snapshot = served.weights.get(request.model_version)
        asked = reduction_request(request)
        wire = request.wire_dtype
        full = asked.name == reductions.NONE and not asked.options
        if wire and not full:
            raise InvalidArgument("wire_dtype: applies to full gradients (reduction none) only")
        selected = served.engine.select(asked.variables)
        row_bytes = sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in selected) if full else 0
        served.engine.check_batch(x, y)  # a malformed batch is refused before admission
        with self._admission.admit(x.shape[0], x.shape[0] * row_bytes):
            if full:
                parts = self._full_gradients(served, snapshot, x, y, asked.variables, wire, context)
            else:
                result = served.engine.per_example_gradients(
                    x,
                    y,
                    reduction=asked.name,
                    variables=asked.variables,
                    trainable=snapshot.trainable,
                    cancelled=lambda: not context.is_active(),
                    **asked.options,
                )
                parts = self._whole_result(served.name, snapshot.version, result)
            for part in parts:
                if isinstance(part, pb.ResultHeader):
                    yield pb.GradientsResponse(request_id=request.request_id, header=part)
                else:
                    yield encode_chunk(request.request_id, *part)

    def _whole_result(
        self, model: str, version: int, result: GradientResult
    ) -> Iterator[pb.ResultHeader | RawChunk]:
        outputs, arrays = result_outputs(result)
        yield pb.ResultHeader(
            model=model,
            model_version=version,
            batch_size=result.batch_size,
            outputs=outputs,
            server=self._config.replica_name,
        )
        for index, array in enumerate(arrays):
            yield from iter_raw_chunks(index, array, chunk_bytes=self._config.chunk_bytes)

    def _full_gradients(
        self,
        served: ServedModel,
        snapshot: Snapshot,
        x: np.ndarray,
        y: np.ndarray,
        variables: list[str] | None,
        wire: int,
        context: grpc.ServicerContext,
    ) -> Iterator[pb.ResultHeader | RawChunk]:
        """Full per-example gradients, streamed block by block.

        A thread computes block k+1 while block k is serialized and sent; the engine
        rotates three sets of block buffers, enough for one block being sent, one
        waiting and one being filled.
        """
        engine = served.engine
        selected = engine.select(variables)
        if wire and wire not in _WIRE_FLOATS:
            raise InvalidArgument(
                f"wire_dtype: {tensor_pb2.DataType.Name(wire)} is not a floating-point type"
            )
        dtypes = [numpy_dtype(wire) if wire else v.dtype for v in selected]
        blocks = engine.iter_slices(
            x, y, variables=variables, trainable=snapshot.trainable, buffer_sets=3
        )
        header = header_for_shapes(
            model=served.name,
            model_version=snapshot.version,
            batch_size=x.shape[0],
            loss_dtype=engine.loss_dtype,
            variables=[(v.name, d, v.shape) for v, d in zip(selected, dtypes, strict=True)],
        )
        header.server = self._config.replica_name
        yield header
        # The cast to the wire dtype runs in the prefetch thread too, beside the sending.
        casted = (
            (
                part.start,
                [
                    part.losses,
                    *(g.astype(d, copy=False) for g, d in zip(part.gradients, dtypes, strict=True)),
                ],
            )
            for part in blocks
        )
        for first, arrays in prefetched(casted, stop=lambda: not context.is_active()):
            for index, array in enumerate(arrays):
                start = first * (array.nbytes // array.shape[0])
                yield from iter_raw_chunks(
                    index, array, start=start, chunk_bytes=self._config.chunk_bytes
                )


_HANDLERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass(frozen=True)
class MalformedRequest:
    """A request whose bytes are not a valid protobuf message of its type."""

    error: str


def _parser(message_class: type) -> Callable[[bytes], Any]:
    """Deserializer that hands malformed bytes to the handler instead of failing in gRPC,
    which would answer INTERNAL; the handler answers INVALID_ARGUMENT."""

    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError as err:
            return MalformedRequest(f"{message_class.__name__}: not a valid message: {err}")

    return parse


def add_to_server(servicer: GradientServicer, server: grpc.Server) -> None:
    """Register the servicer like the generated `add_GradientServiceServicer_to_server`,
    except that responses may be pre-encoded bytes (`pergrad.client._wire`) and malformed
    requests reach the handler (`MalformedRequest`)."""
    service = pb.DESCRIPTOR.services_by_name["GradientService"]
    handlers = {
        method.name: _HANDLERS[method.client_streaming, method.server_streaming](
            getattr(servicer, method.name),
            request_deserializer=_parser(getattr(pb, method.input_type.name)),
            response_serializer=serialize,
        )
        for method in service.methods
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)
