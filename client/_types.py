"""The client's description and error types; results are `pergrad.wire.results`'."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2
from pergrad.wire.codec import CodecError, checked_shape, declared_nbytes, numpy_dtype

_T = TypeVar("_T")

# The most bytes a model's variables may declare in its ModelInfo (GradientClient's
# `max_model_bytes`): what get_weights allocates, and full gradients per example. A
# server declaring more is not believed (DATA_LOSS).
MAX_MODEL_BYTES = 16 << 30

# What a server's malformed answer raises as the client reads it: bytes that do not parse,
# declarations the codec refuses, or numpy and Python refusing what was declared.
_MALFORMED = (CodecError, DecodeError, ValueError, OverflowError, MemoryError, TypeError, KeyError)


class PergradError(Exception):
    """A failed pergrad call: the gRPC status code and the server's message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def invalid(message: str) -> PergradError:
    return PergradError(grpc.StatusCode.INVALID_ARGUMENT, message)


def data_loss(message: str) -> PergradError:
    return PergradError(grpc.StatusCode.DATA_LOSS, message)


@contextlib.contextmanager
def answer_checked(what: str) -> Iterator[None]:
    """Any fault of a server's answer found inside is a PergradError with DATA_LOSS, its
    message starting with `what`. Wrap only the reading of an answer: a caller's own
    mistakes must not become DATA_LOSS."""
    try:
        yield
    except _MALFORMED as err:
        message = str(err) if isinstance(err, CodecError) else f"{type(err).__name__}: {err}"
        raise data_loss(f"{what}{message}") from None


def from_rpc_error(err: grpc.RpcError) -> PergradError:
    return PergradError(err.code(), err.details() or "")


def rpc_errors(fn: Callable[..., _T]) -> Callable[..., _T]:
    """Turn gRPC failures into PergradError (status code + the server's message)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    return wrapper


@dataclass(frozen=True)
class TensorInfo:
    """Name, dtype and shape of a tensor; -1 in `shape` stands for the batch."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @classmethod
    def from_proto(cls, spec: tensor_pb2.TensorSpec) -> TensorInfo:
        return cls(spec.name, numpy_dtype(spec.dtype), tuple(spec.shape))


_FLOAT32 = np.dtype(np.float32)


class MixedPlansWarning(UserWarning):
    """A result assembled from replicas that compute the model differently (ModelInfo.plan)."""


@dataclass(frozen=True)
class ServerLimits:
    """A replica's limits on one gradients request (its flags); over one is
    RESOURCE_EXHAUSTED. Zero where the server did not say (and, for
    max_coalesced_batch, where it shares no passes: the default on a CPU)."""

    max_batch: int = 0
    max_request_bytes: int = 0
    max_inflight_examples: int = 0
    max_inflight_bytes: int = 0
    max_coalesced_batch: int = 0

    @classmethod
    def from_proto(cls, limits: pb.ServerLimits) -> ServerLimits:
        return cls(**{f.name: getattr(limits, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class ModelInfo:
    name: str
    model_version: int
    variables: tuple[TensorInfo, ...]
    input: TensorInfo
    labels: TensorInfo
    loss: str
    num_classes: int
    server: str = ""
    weights_id: str = ""
    inputs: tuple[TensorInfo, ...] = ()  # every input, by name, in model order
    limits: ServerLimits = ServerLimits()
    plan: str = ""  # XLA or not, slice size, each layer's route
    plan_id: str = ""  # its fingerprint: equal on replicas that compute the same bits
    loss_dtype: np.dtype = _FLOAT32  # of every result's losses
    optimizer: str = ""  # what ApplyStep (`GradientClient.step`) applies updates with
    routes: tuple[str, ...] = ()  # each variable's route: "rule: ...", "generic: ...", ...
    lora: str = ""  # the LoRA the server enabled (--lora); empty: none
    keras_version: str = ""  # the server's Keras, whose optimizer class `optimizer` names

    @property
    def route_of(self) -> dict[str, str]:
        """Each variable's route by name (empty from a server that does not say)."""
        return dict(zip((v.name for v in self.variables), self.routes, strict=False))

    @classmethod
    def from_proto(cls, info: pb.ModelInfo, *, max_bytes: int = MAX_MODEL_BYTES) -> ModelInfo:
        """CodecError for a dtype pergrad does not know, a variable shape that is none
        (`codec.checked_shape`), or variables of more than `max_bytes` in all."""
        variables = tuple(TensorInfo.from_proto(v) for v in info.variables)
        total = sum(
            declared_nbytes(v.dtype, checked_shape(v.shape, what=f"variable {v.name!r}"))
            for v in variables
        )
        if total > max_bytes:
            raise CodecError(
                f"its variables declare {total} bytes, more than this client's "
                f"max_model_bytes ({max_bytes})"
            )
        return cls(
            name=info.name,
            model_version=info.model_version,
            variables=variables,
            input=TensorInfo.from_proto(info.input),
            labels=TensorInfo.from_proto(info.labels),
            loss=info.loss,
            num_classes=info.num_classes,
            server=info.server,
            weights_id=info.weights_id,
            inputs=tuple(TensorInfo.from_proto(t) for t in info.inputs)
            or (TensorInfo.from_proto(info.input),),
            limits=ServerLimits.from_proto(info.limits),
            plan=info.plan,
            plan_id=info.plan_id,
            loss_dtype=numpy_dtype(info.loss_dtype) if info.loss_dtype else _FLOAT32,
            optimizer=info.optimizer,
            routes=tuple(info.routes),
            lora=info.lora,
            keras_version=info.keras_version,
        )

    @property
    def num_parameters(self) -> int:
        return sum(int(np.prod(v.shape)) for v in self.variables)
