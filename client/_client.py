"""GradientClient: per-example gradients and weights of models served by pergrad."""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from pergrad.client._codec import (
    DEFAULT_CHUNK_BYTES,
    CodecError,
    TensorAssembler,
    iter_chunks,
    tensor_spec,
)
from pergrad.client._requests import gradients_request
from pergrad.client._results import read_results
from pergrad.client._types import GradientResult, ModelInfo, PergradError
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import gradient_service_pb2_grpc as pb_grpc

DEFAULT_TIMEOUT_S = 120.0
MAX_RECEIVE_BYTES = 64 << 20

_T = TypeVar("_T")


def _rpc_errors(fn: Callable[..., _T]) -> Callable[..., _T]:
    """Turn gRPC failures into PergradError (status code + the server's message)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        try:
            return fn(*args, **kwargs)
        except grpc.RpcError as err:
            raise PergradError(err.code(), err.details() or "") from None

    return wrapper


class GradientClient:
    """Talks to one pergrad server (or a name that resolves to several).

    Args:
        target: gRPC target, e.g. "localhost:50051".
        timeout: default deadline in seconds for each unary or result call.
        chunk_bytes: size of the chunks `set_weights` sends.
        max_in_flight: batches `stream` keeps on the wire before waiting for results.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_in_flight: int = 2,
        options: Iterable[tuple[str, Any]] = (),
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        channel_options = [
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
            ("grpc.max_send_message_length", -1),
            *options,
        ]
        self._channel = grpc.insecure_channel(target, options=channel_options)
        self._stub = pb_grpc.GradientServiceStub(self._channel)
        self._timeout = timeout
        self._chunk_bytes = chunk_bytes
        self._max_in_flight = max_in_flight
        self._infos: dict[str, ModelInfo] = {}

    def __enter__(self) -> GradientClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    @_rpc_errors
    def list_models(self, *, timeout: float | None = None) -> list[str]:
        reply = self._stub.ListModels(pb.ListModelsRequest(), timeout=timeout or self._timeout)
        return list(reply.models)

    @_rpc_errors
    def model_info(self, model: str, *, timeout: float | None = None) -> ModelInfo:
        reply = self._stub.GetModelInfo(
            pb.GetModelInfoRequest(model=model), timeout=timeout or self._timeout
        )
        info = ModelInfo.from_proto(reply)
        self._infos[model] = info
        return info

    def _info(self, model: str) -> ModelInfo:
        return self._infos.get(model) or self.model_info(model)

    @_rpc_errors
    def per_example_gradients(
        self,
        model: str,
        x: Any,
        y: Any,
        *,
        reduction: str = "none",
        variables: Sequence[str] | None = None,
        model_version: int = 0,
        timeout: float | None = None,
        **options: Any,
    ) -> GradientResult:
        """Per-example losses [B] and gradients {variable: [B, *shape]} of one batch,
        or a server-side reduction of them.

        Args:
            reduction: "none" (full gradients), "norms", "clipped_sum" (options
                max_norm, noise_multiplier, seed), "moments", "dot" (reference:
                {variable: [K, *shape]}) or "project" (dim, seed, kind="rademacher" or
                "gaussian"); see `GradientResult` for the fields each fills.
            variables: restrict any reduction to these variables.
            model_version: pin the weights: FAILED_PRECONDITION unless it is current.
        """
        request = gradients_request(
            self._info(model),
            x,
            y,
            model_version=model_version,
            reduction=reduction,
            variables=variables,
            options=options,
        )
        responses = self._stub.ComputePerExampleGradients(request, timeout=timeout or self._timeout)
        results = [result for _, result in read_results(responses)]
        if len(results) != 1:
            raise PergradError(grpc.StatusCode.DATA_LOSS, f"expected 1 result, got {len(results)}")
        return results[0]

    def stream(
        self,
        model: str,
        batches: Iterable[tuple[Any, Any]],
        *,
        reduction: str = "none",
        variables: Sequence[str] | None = None,
        model_version: int = 0,
        timeout: float | None = None,
        **options: Any,
    ) -> Iterator[GradientResult]:
        """Results of many (x, y) batches on one call, in order, pipelined.

        Takes the same reduction arguments as `per_example_gradients`. At most
        `max_in_flight` batches wait on the wire; `timeout` bounds the whole stream
        (default: no deadline).
        """
        info = self._info(model)
        window = threading.Semaphore(self._max_in_flight)
        finished = threading.Event()
        failures: list[PergradError] = []

        def requests() -> Iterator[pb.GradientsRequest]:
            try:
                for request_id, (x, y) in enumerate(batches, start=1):
                    while not window.acquire(timeout=0.1):
                        if finished.is_set():
                            return
                    yield gradients_request(
                        info,
                        x,
                        y,
                        model_version=model_version,
                        reduction=reduction,
                        variables=variables,
                        options=options,
                        request_id=request_id,
                    )
            except PergradError as err:
                failures.append(err)

        responses = self._stub.StreamPerExampleGradients(requests(), timeout=timeout)
        try:
            results = read_results(responses)
            for expected_id, (request_id, result) in zip(itertools.count(1), results):
                if request_id != expected_id:
                    raise PergradError(
                        grpc.StatusCode.DATA_LOSS,
                        f"result for request {request_id} arrived, expected {expected_id}",
                    )
                window.release()
                yield result
        except grpc.RpcError as err:
            raise PergradError(err.code(), err.details() or "") from None
        finally:
            finished.set()
            responses.cancel()
        if failures:
            raise failures[0]

    @_rpc_errors
    def get_weights(
        self, model: str, *, timeout: float | None = None
    ) -> tuple[int, dict[str, np.ndarray]]:
        """(version, {variable: array}) of the model's current weights."""
        responses = self._stub.GetWeights(
            pb.GetWeightsRequest(model=model), timeout=timeout or self._timeout
        )
        header = next(responses).header
        assembler = TensorAssembler(header.tensors)
        try:
            for message in responses:
                assembler.add(message.chunk)
            arrays = assembler.arrays()
        except CodecError as err:
            raise PergradError(grpc.StatusCode.DATA_LOSS, str(err)) from None
        return header.model_version, {
            spec.name: array for spec, array in zip(header.tensors, arrays, strict=True)
        }

    @_rpc_errors
    def set_weights(
        self,
        model: str,
        weights: Mapping[str, Any],
        *,
        expected_version: int = 0,
        timeout: float | None = None,
    ) -> int:
        """Replace every trainable variable at once; returns the new version.

        With `expected_version`, the update applies only if that version is still
        current (FAILED_PRECONDITION otherwise), so concurrent writers cannot clobber
        each other. Arrays are cast to the variables' dtypes.
        """
        dtypes = {v.name: v.dtype for v in self._info(model).variables}
        arrays = {
            name: np.ascontiguousarray(value, dtype=dtypes.get(name))
            for name, value in weights.items()
        }

        def messages() -> Iterator[pb.WeightsMessage]:
            specs = [tensor_spec(name, array) for name, array in arrays.items()]
            yield pb.WeightsMessage(
                header=pb.WeightsHeader(model=model, model_version=expected_version, tensors=specs)
            )
            for index, array in enumerate(arrays.values()):
                for chunk in iter_chunks(index, array, chunk_bytes=self._chunk_bytes):
                    yield pb.WeightsMessage(chunk=chunk)

        reply = self._stub.SetWeights(messages(), timeout=timeout or self._timeout)
        return reply.model_version
