"""The gRPC servicer: each method parses, calls the engine or the weights store, and
encodes the answer. Errors become status codes in `status` only."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from functools import partial
from typing import Any

import grpc
import numpy as np

from pergrad.server.admission import calls
from pergrad.server.admission.inflight import Admission
from pergrad.server.coalescer import UNRESOLVED_COALESCING, Coalescers
from pergrad.server.config import Config
from pergrad.server.errors import InvalidArgument, PergradServerError
from pergrad.server.gradients import (
    Settings,
    oversized_batch,
    prepare,
    responses,
    served_plan,
)
from pergrad.server.metrics import ServerMetrics
from pergrad.server.models.registry import ModelRegistry, ServedModel
from pergrad.server.status import Refusal, parser, request_bytes, status
from pergrad.server.steps import apply_step
from pergrad.server.tracking import tracked
from pergrad.server.training import KERAS_VERSION
from pergrad.server.transport.handlers import kind
from pergrad.server.weights import Snapshot
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import gradient_service_pb2_grpc as pb_grpc
from pergrad.v1 import tensor_pb2
from pergrad.wire.chunks import serialize
from pergrad.wire.codec import (
    TensorAssembler,
    encode_tensor,
    iter_chunks,
    numpy_dtype,
    tensor_spec,
    wire_dtype,
)
from pergrad.wire.declared import (
    declared_model,
    declared_request_id,
    first_nested_string,
    holds_over,
)
from pergrad.wire.fields import field_bytes
from pergrad.wire.rpc import SERVICE

_LOGGER = logging.getLogger(__name__)
# Gradients requests this large or larger have their batch read from their bytes before
# they are parsed: upb parsed a 57 MiB request in 50-120 ms, but a small one in 1-30 us,
# against 16 us to read a plain request's fields and 244 us for a `dot` of 214
# references (one Python step per field).
READ_UNPARSED_FROM = 1 << 20


def _batched_spec(
    name: str, dtype: np.dtype, shape: tuple[int | None, ...]
) -> tensor_pb2.TensorSpec:
    """Spec with -1 for the batch and for any per-example dimension of free size."""
    dims = [-1, *(-1 if d is None else d for d in shape)]
    return tensor_pb2.TensorSpec(name=name, dtype=wire_dtype(dtype), shape=dims)


def _variable_specs(served: ServedModel) -> list[tensor_pb2.TensorSpec]:
    """Each trainable variable as GetModelInfo lists it and a SetWeights header names it."""
    return [
        tensor_pb2.TensorSpec(name=v.name, dtype=wire_dtype(v.dtype), shape=v.shape)
        for v in served.engine.variables
    ]


def _header_bound(registry: ModelRegistry) -> int:
    """Twice the bytes of the largest WeightsHeader a served model takes, every field at
    its widest, and 4 KiB: room for shapes sent unpacked and fields a newer client sets."""
    sizes = [
        pb.WeightsHeader(
            model=name,
            model_version=-1,
            new_version=-1,
            weights_id="0" * 32,
            tensors=_variable_specs(registry.get(name)),
        ).ByteSize()
        for name in registry.names
    ]
    return 2 * max(sizes, default=0) + 4096


def max_request_bytes(config: Config, registry: ModelRegistry) -> int:
    """--max-request-bytes, auto resolved for the served models (`Config.request_bytes_bound`)."""
    most = max((_unsplittable_bytes(registry.get(n)) for n in registry.names), default=0)
    return config.request_bytes_bound(most)


def _unsplittable_bytes(served: ServedModel) -> int:
    """What a request to the model holds that no client can split: one value per
    variable element, float32 at least (a `dot` reference row, or a step's gradient
    sum), and one example (a dimension of free size counted as 1)."""
    engine = served.engine
    variables = sum(
        int(np.prod(v.shape, dtype=np.int64)) * max(4, np.dtype(v.dtype).itemsize)
        for v in engine.variables
    )
    example = [(s.shape, s.dtype) for s in engine.input_specs]
    example.append((engine.label_spec.shape, engine.label_spec.dtype))
    return variables + sum(
        int(np.prod([d or 1 for d in shape], dtype=np.int64)) * np.dtype(dtype).itemsize
        for shape, dtype in example
    )


class OversizedHeader(InvalidArgument):
    """A SetWeights header refused from its size, and the model it names (the first name
    sent; None if none could be read), whose update has failed."""

    def __init__(self, message: str, *, model: str | None) -> None:
        super().__init__(message)
        self.model = model


def _fields_needed(registry: ModelRegistry) -> int:
    """The most top-level fields a request to a served model holds: a variable name and
    a `dot` reference (or a step's gradient-sum tensor) per variable, a tensor per
    input, every other field once."""
    most = max(
        (
            2 * len(registry.get(name).engine.variables)
            + len(registry.get(name).engine.input_specs)
            for name in registry.names
        ),
        default=0,
    )
    others = max(len(pb.GradientsRequest.DESCRIPTOR.fields), len(pb.StepRequest.DESCRIPTOR.fields))
    return most + others


class GradientServicer(pb_grpc.GradientServiceServicer):
    def __init__(
        self,
        registry: ModelRegistry,
        config: Config,
        metrics: ServerMetrics | None = None,
        coalescers: Coalescers | None = None,
        admission: Admission | None = None,
    ) -> None:
        if config.max_coalesced_batch is None:
            raise ValueError(UNRESOLVED_COALESCING)
        self._registry = registry
        self._config = config
        self.metrics = metrics if metrics is not None else ServerMetrics()
        self._coalescers = coalescers
        self._admission = admission or Admission(
            max_examples=config.max_inflight_examples, max_bytes=config.max_inflight_bytes
        )
        self._settings = Settings(
            config.max_batch, config.chunk_bytes, config.replica_name, config.max_coalesced_batch
        )
        self._max_request_bytes = max_request_bytes(config, registry)
        self._header_bound = _header_bound(registry)
        self._fields_needed = _fields_needed(registry)
        # Twice as many, and 64: room for fields sent twice and fields a newer client sets.
        self._field_bound = 2 * self._fields_needed + 64

    def oversized_header(self, data: bytes) -> InvalidArgument | None:
        """The refusal of a SetWeights message whose header is larger than any served
        model's could be, unparsed (parsing 60,000 specs would hold the GIL 5 ms),
        naming the model it would update (`SetWeights` counts the failure)."""
        size = field_bytes(data, pb.WeightsMessage.HEADER_FIELD_NUMBER)
        if size <= self._header_bound:
            return None
        return OversizedHeader(
            f"WeightsMessage: a header of {size} bytes; the bound is {self._header_bound}, "
            "twice the largest a served model takes plus 4 KiB (one TensorSpec per "
            "trainable variable: GetModelInfo lists them)",
            model=first_nested_string(
                data, pb.WeightsMessage.HEADER_FIELD_NUMBER, pb.WeightsHeader.MODEL_FIELD_NUMBER
            ),
        )

    def refusals(self) -> dict[str, Refusal]:
        """Per method, what refuses a request from its bytes before it is parsed (a
        gradients request's batch only where the request is large)."""
        max_batch = self._config.max_batch
        step_batch = pb.StepRequest.BATCH_FIELD_NUMBER
        many = self._too_many_fields
        return {
            "SetWeights": self.oversized_header,
            "ComputePerExampleGradients": _first(
                partial(many, "GradientsRequest"),
                _if_large(partial(oversized_batch, max_batch=max_batch)),
            ),
            "StreamPerExampleGradients": _first(
                partial(many, "GradientsRequest"),
                _if_large(partial(_oversized_streamed_batch, max_batch=max_batch)),
            ),
            "ApplyStep": self._counted_as_failed_step(
                _first(
                    partial(many, "StepRequest (or its batch)", in_field=step_batch),
                    _if_large(partial(oversized_batch, max_batch=max_batch, in_field=step_batch)),
                )
            ),
        }

    def _too_many_fields(self, what: str, data: bytes, in_field: int = 0) -> InvalidArgument | None:
        """The refusal of a request holding more fields than any request to a served model
        could (`_field_bound`), unparsed: upb takes ~1 us a small field, with the GIL held
        (80,000 `dot` references, 0.9 MiB: 90 ms). A message of n bytes holds n/2 fields
        at most, so only longer ones are read."""
        if len(data) <= 2 * self._field_bound or not holds_over(data, self._field_bound, in_field):
            return None
        return InvalidArgument(
            f"{what}: over {self._field_bound} fields, the bound: twice the "
            f"{self._fields_needed} a request to this server's models holds at most (a "
            "variable name and a `dot` reference or gradient-sum tensor per variable, a "
            "tensor per input, every other field once), and 64; or a group, which no "
            "proto3 message holds"
        )

    def _counted_as_failed_step(self, refuse: Refusal) -> Refusal:
        """`refuse`, counting each refusal as `ApplyStep` counts a failed step: for the
        served model the bytes name, if any (SetWeights' stream may count it itself)."""

        def refuse_counted(data: bytes) -> PergradServerError | None:
            error = refuse(data)
            if error is not None:
                model = declared_model(data, pb.StepRequest.MODEL_FIELD_NUMBER)
                if model in self._registry.names:
                    self.metrics.weights_update_failed(model)
            return error

        return refuse_counted

    @status
    def ListModels(self, request: pb.ListModelsRequest, context: Any) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=self._registry.names)

    @status
    def GetModelInfo(self, request: pb.GetModelInfoRequest, context: Any) -> pb.ModelInfo:
        served = self._registry.get(request.model)
        engine = served.engine
        plan, plan_id = served_plan(engine, self._settings.max_coalesced_batch)
        return pb.ModelInfo(
            name=served.name,
            model_version=served.weights.current.version,
            weights_id=served.weights.current.weights_id,
            variables=_variable_specs(served),
            input=_batched_spec("input", engine.input_spec.dtype, engine.input_spec.shape),
            inputs=[_batched_spec(i.name, i.dtype, i.shape) for i in engine.input_specs],
            labels=_batched_spec("labels", engine.label_spec.dtype, engine.label_spec.shape),
            loss=engine.loss.description,
            num_classes=engine.label_spec.num_classes,
            server=self._config.replica_name,
            limits=pb.ServerLimits(
                max_batch=self._config.max_batch,
                max_request_bytes=self._max_request_bytes,
                max_inflight_examples=self._config.max_inflight_examples,
                max_inflight_bytes=self._config.max_inflight_bytes,
                max_coalesced_batch=self._config.max_coalesced_batch,
            ),
            plan=plan,
            plan_id=plan_id,
            loss_dtype=wire_dtype(engine.loss_dtype),
            optimizer=served.trainer.description,
            routes=engine.routes,
            lora=served.lora,
            keras_version=KERAS_VERSION,
        )

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
        except OversizedHeader as err:  # refused unparsed: its model is read from its bytes
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
        versions = {
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
        self, request: pb.GradientsRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GradientsResponse]:
        messages = self._gradients(request, context, held_bytes=request_bytes(context, request))
        yield from tracked(self.metrics, request, messages, context)

    @status
    def StreamPerExampleGradients(
        self, request_iterator: Iterator[pb.GradientsRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.GradientsResponse]:
        for request in request_iterator:
            try:
                messages = self._gradients(request, context)
                yield from tracked(self.metrics, request, messages, context)
            except PergradServerError as err:
                raise _naming_request(err, request.request_id) from err

    @status
    def ApplyStep(self, request: pb.StepRequest, context: grpc.ServicerContext) -> pb.StepResponse:
        served = self._registry.get(request.model)
        try:
            step = apply_step(
                served,
                request,
                self._settings,
                self._admission,
                cancelled=lambda: not context.is_active(),
                caller=calls.of(context).caller,
                held_bytes=request_bytes(context, request),
            )
        except Exception:
            self.metrics.weights_update_failed(served.name)
            raise
        snapshot = step.snapshot
        self.metrics.weights_updated(served.name, snapshot.version)
        response = pb.StepResponse(
            model=served.name,
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

    def _gradients(
        self, request: pb.GradientsRequest, context: grpc.ServicerContext, held_bytes: int = 0
    ) -> Iterator[pb.GradientsResponse | bytes]:
        """The responses to one request; `held_bytes`: its message's, which the guard
        holds from its arrival (a one-request call's; a stream's are not held)."""
        served = self._registry.get(request.model)
        work = prepare(served, request, self._settings)
        coalescer = None
        if self._coalescers is not None:
            coalescer = self._coalescers.get(served.name, served.engine)
        yield from responses(
            work,
            request.request_id,
            self._admission,
            self._settings,
            cancelled=lambda: not context.is_active(),
            coalescer=coalescer,
            caller=calls.of(context).caller,
            held_bytes=held_bytes,
        )


def _first(*refusals: Refusal) -> Refusal:
    """The first of `refusals` that refuses the bytes, in order."""

    def refuse(data: bytes) -> PergradServerError | None:
        return next((e for r in refusals if (e := r(data)) is not None), None)

    return refuse


def _if_large(refuse: Refusal) -> Refusal:
    """`refuse` for requests of READ_UNPARSED_FROM bytes or more; smaller ones cost less
    to parse than to read field by field in Python."""
    return lambda data: refuse(data) if len(data) >= READ_UNPARSED_FROM else None


def _naming_request(error: PergradServerError, request_id: int) -> PergradServerError:
    """An error of one request of a stream, naming the request by its id."""
    return type(error)(f"request {request_id}: {error}")


def _oversized_streamed_batch(data: bytes, max_batch: int) -> PergradServerError | None:
    error = oversized_batch(data, max_batch)
    if error is None:
        return None
    return _naming_request(error, declared_request_id(data))


def add_to_server(servicer: GradientServicer, server: grpc.Server) -> None:
    """Register the servicer like the generated `add_GradientServiceServicer_to_server`,
    except that responses may be pre-encoded bytes (`pergrad.wire.chunks`) and malformed
    requests reach the handler (`RefusedRequest`), as do requests refused from their
    bytes before they are parsed (`GradientServicer.refusals`)."""
    refusals = servicer.refusals()
    handlers = {
        method.name: kind(method.client_streaming, method.server_streaming).factory(
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
