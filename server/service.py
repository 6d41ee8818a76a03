"""The gRPC servicer: each method parses, calls the engine or the weights store, and
encodes the answer. Errors become status codes in `status` only."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc

from pergrad.server.admission import calls
from pergrad.server.admission.inflight import Admission
from pergrad.server.admission.unparsed import request_bytes_limit
from pergrad.server.config import Config
from pergrad.server.errors import InvalidArgument, PergradServerError, RefusedUnparsed
from pergrad.server.gradients import Charge, Settings, prepare, responses
from pergrad.server.metrics import ServerMetrics
from pergrad.server.model_info import model_info
from pergrad.server.models.registry import ModelRegistry, ServedModel
from pergrad.server.sharing import Coalescers
from pergrad.server.status import Refusal, parser, status
from pergrad.server.steps import Step, apply_step
from pergrad.server.tracking import tracked
from pergrad.server.transport.chunked import RequestBounds, whole_request
from pergrad.server.transport.handlers import kind
from pergrad.server.weights import Snapshot
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import gradient_service_pb2_grpc as pb_grpc
from pergrad.wire.chunked_requests import Whole
from pergrad.wire.chunks import serialize
from pergrad.wire.codec import (
    TensorAssembler,
    encode_tensor,
    iter_chunks,
    numpy_dtype,
    tensor_spec,
)
from pergrad.wire.rpc import SERVICE, registered

_LOGGER = logging.getLogger(__name__)


def _counted_as_update(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` (ApplyStep), counting a failed call for the served model its request
    names, whether the method failed or the request was refused on the way: from its
    bytes, or while its chunks were read (`RefusedRequest.model`)."""

    @functools.wraps(method)
    def counted(self: GradientServicer, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception:
            model = getattr(request, "model", None)
            if model in self._registry.names:
                self.metrics.weights_update_failed(model)
            raise

    return counted


class GradientServicer(pb_grpc.GradientServiceServicer):
    def __init__(
        self,
        registry: ModelRegistry,
        config: Config,
        metrics: ServerMetrics | None = None,
        coalescers: Coalescers | None = None,
        admission: Admission | None = None,
    ) -> None:
        self._settings = Settings.of(config)
        self._registry = registry
        self._config = config
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._coalescers = coalescers
        self._admission = admission or Admission(
            max_examples=config.max_inflight_examples, max_bytes=config.max_inflight_bytes
        )
        self._max_request_bytes = request_bytes_limit(config, registry)
        self._bounds = RequestBounds(
            self._max_request_bytes, config.max_batch, config.stall_timeout_s
        )

    @status
    def ListModels(self, request: pb.ListModelsRequest, context: Any) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=self._registry.names)

    @status
    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Any) -> pb.ModelInfo:
        served = self._registry.get(request.model)
        return model_info(served, self._config, self._max_request_bytes)

    @status
    def GetWeights(
        self, request: pb.GetWeightsRequest, context: Any
    ) -> Iterator[pb.WeightsMessage]:
        served = self._registry.get(request.model)
        snapshot = served.weights.current
        arrays = served.weights.arrays(snapshot)
        specs = [tensor_spec(name, array) for name, array in arrays.items()]
        yield pb.WeightsMessage(
            header=pb.WeightsHeader(
                model=served.name,
                model_version=snapshot.version,
                weights_id=snapshot.weights_id,
                tensors=specs,
            )
        )
        for index, array in enumerate(arrays.values()):
            for chunk in iter_chunks(index, array, chunk_bytes=self._config.chunk_bytes):
                yield pb.WeightsMessage(chunk=chunk)

    @status
    def SetWeights(
        self, request_iterator: Iterator[pb.WeightsMessage], context: Any
    ) -> pb.SetWeightsResponse:
        try:
            first = next(request_iterator, None)
        except RefusedUnparsed as err:  # its model read from its bytes
            if err.model in self._registry.names:
                self.metrics.weights_update_failed(err.model)
            raise
        if first is None or not first.HasField("header"):
            raise InvalidArgument("SetWeights: the first message must be a WeightsHeader")
        header = first.header
        served = self._registry.get(header.model)
        try:
            snapshot = self._replace_weights(served, header, request_iterator)
        except Exception:
            self.metrics.weights_update_failed(served.name)
            raise
        self.metrics.weights_updated(served.name, snapshot.version)
        _LOGGER.info("model %s: weights version %d", served.name, snapshot.version)
        return pb.SetWeightsResponse(
            model=served.name, model_version=snapshot.version, weights_id=snapshot.weights_id
        )

    @staticmethod
    def _replace_weights(
        served: ServedModel, header: pb.WeightsHeader, chunks: Iterator[pb.WeightsMessage]
    ) -> Snapshot:
        """Check the header, fill the tensors from the chunks, swap them in."""
        served.weights.check_count(len(header.tensors))  # before 60,000 specs are decoded
        served.weights.check(
            [(t.name, numpy_dtype(t.dtype), tuple(t.shape)) for t in header.tensors]
        )
        versions: dict[str, Any] = {
            "expected_version": header.model_version,
            "expected_id": header.weights_id,
            "new_version": header.new_version,
        }
        served.weights.check_update(**versions)  # before the chunks are read
        assembler = TensorAssembler(header.tensors)
        for message in chunks:
            if not message.HasField("chunk"):
                raise InvalidArgument("SetWeights: one header first, then only chunks")
            assembler.add(message.chunk)
        arrays = dict(zip((t.name for t in header.tensors), assembler.arrays(), strict=True))
        return served.weights.replace(arrays, **versions)

    @status
    def ComputePerExampleGradients(
        self, request: Whole, context: grpc.ServicerContext
    ) -> Iterator[pb.GradientsResponse | bytes]:
        """`request` read whole by the guard, its chunks assembled (`whole_request`)."""
        messages = self._gradients(request, self._charge(context))
        yield from tracked(self.metrics, request.message, messages, context)

    @status
    def StreamPerExampleGradients(
        self, request_iterator: Iterator[pb.GradientsRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.GradientsResponse | bytes]:
        for first in request_iterator:
            try:
                request = whole_request(
                    first, request_iterator, call=calls.of(context), bounds=self._bounds
                )
                messages = self._gradients(request, self._charge(context))
                yield from tracked(self.metrics, first, messages, context)
            except PergradServerError as err:  # the request named by its id
                raise type(err)(f"request {first.request_id}: {err}") from err

    @_counted_as_update
    @status
    def ApplyStep(self, request: Whole, context: grpc.ServicerContext) -> pb.StepResponse:
        served = self._registry.get(request.model)
        respond = functools.partial(self._step_response, served.name)
        response, applied = apply_step(
            served, request, self._settings, self._charge(context), respond
        )
        if applied:
            self.metrics.weights_updated(served.name, response.model_version)
        return response

    def _step_response(self, model: str, step: Step) -> pb.StepResponse:
        snapshot = step.snapshot
        response = pb.StepResponse(
            model=model,
            model_version=snapshot.version,
            weights_id=snapshot.weights_id,
            server=self._config.replica_name,
            gradient_norm=step.gradient_norm,
            update_norms=step.moved,
        )
        if step.result is not None:
            response.losses.CopyFrom(encode_tensor(step.result.losses))
            if step.result.norms is not None:
                response.norms.CopyFrom(encode_tensor(step.result.norms))
                response.num_clipped = int(step.result.num_clipped)
        return response

    def _charge(self, context: grpc.ServicerContext) -> Charge:
        """What the call's work is charged to: its caller, the bytes the guard holds for
        it since its arrival (a one-request call's request; a stream's are not held);
        and stopped by: the call's end."""
        record = calls.of(context)
        return Charge(
            self._admission, lambda: not context.is_active(), record.caller, record.held_bytes
        )

    def _gradients(self, request: Whole, charge: Charge) -> Iterator[pb.GradientsResponse | bytes]:
        """The responses to one request."""
        served = self._registry.get(request.model)
        work = prepare(served, request, self._settings)
        coalescer = None
        if self._coalescers is not None:
            coalescer = self._coalescers.get(served.name, served.engine)
        yield from responses(work, request.message.request_id, self._settings, charge, coalescer)


def add_to_server(
    servicer: GradientServicer, server: grpc.Server, refusals: Mapping[str, Refusal]
) -> None:
    """Register the servicer like the generated `add_GradientServiceServicer_to_server`,
    except that responses may be pre-encoded bytes (`pergrad.wire.chunks`) and malformed
    requests reach the handler (`RefusedRequest`), as do requests refused from their
    bytes before they are parsed (`refusals`, by method: `admission.unparsed`)."""
    handlers = {
        method.name: kind(*registered(method)).factory(
            getattr(servicer, method.name),
            request_deserializer=parser(
                getattr(pb, method.input_type.name), refusals.get(method.name)
            ),
            response_serializer=serialize,
        )
        for method in SERVICE.methods
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
