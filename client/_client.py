"""GradientClient: per-example gradients and weights of models served by pergrad."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import grpc
import numpy as np

from pergrad.client._channels import SERVICE, open_channel, replica_addresses
from pergrad.client._codec import (
    DEFAULT_CHUNK_BYTES,
    CodecError,
    TensorAssembler,
    iter_chunks,
    tensor_spec,
)
from pergrad.client._credentials import PemSource, Security
from pergrad.client._merge import merge
from pergrad.client._requests import gradients_request
from pergrad.client._results import read_results
from pergrad.client._stream import pipelined
from pergrad.client._types import GradientResult, ModelInfo, PergradError
from pergrad.client._wire import identity
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import gradient_service_pb2_grpc as pb_grpc

DEFAULT_TIMEOUT_S = 120.0
# A replica that dies mid-call answers UNAVAILABLE; its share goes to another replica.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
# The gradients methods' responses are decoded by `_wire`, not by protobuf.
COMPUTE_METHOD = f"/{SERVICE}/ComputePerExampleGradients"
STREAM_METHOD = f"/{SERVICE}/StreamPerExampleGradients"

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
    """Talks to one pergrad server, or spreads work over several.

    Args:
        target: "host:port"; "ipv4:h1:50051,h2:50051" for a fixed list of replicas;
            "dns:///name:50051" for every address of a name (a Kubernetes headless
            Service). gRPC's round_robin policy spreads calls over the replicas.
        timeout: default deadline in seconds for each call.
        chunk_bytes: size of the chunks `set_weights` sends.
        max_in_flight: batches `stream` keeps on the wire before waiting for results.
        micro_batch: split a batch into micro-batches of this many examples, computed
            concurrently (on several replicas) and reassembled in order.
        retries: times a call that found its replica gone is sent again.
        tls: use TLS, trusting the system's root certificates unless
            `root_certificates` is given (any certificate argument implies TLS).
        root_certificates: CA certificates that sign the server's certificate: PEM
            bytes, or the path of a PEM file (as are the next two).
        certificate_chain, private_key: the client's certificate and key, for a server
            that requires them (mutual TLS).
        token: bearer token sent with every call (`authorization: Bearer <token>`);
            over TLS as call credentials, else as plain metadata.
        server_name: the name the servers' certificates are checked against, where it
            is not the target's host; needed for TLS to an ipv4:/ipv6: list.
    """

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_in_flight: int = 2,
        micro_batch: int | None = None,
        retries: int = 2,
        options: Iterable[tuple[str, Any]] = (),
        tls: bool = False,
        root_certificates: PemSource | None = None,
        certificate_chain: PemSource | None = None,
        private_key: PemSource | None = None,
        token: str | None = None,
        server_name: str | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if micro_batch is not None and micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        self._target = target
        self._options = list(options)
        self._security = Security.of(
            tls=tls,
            root_certificates=root_certificates,
            certificate_chain=certificate_chain,
            private_key=private_key,
            token=token,
            server_name=server_name,
        )
        self._channel = open_channel(target, self._options, self._security)
        self._stub = pb_grpc.GradientServiceStub(self._channel)
        self._compute_call = self._channel.unary_stream(
            COMPUTE_METHOD,
            request_serializer=pb.GradientsRequest.SerializeToString,
            response_deserializer=identity,
        )
        self._stream_call = self._channel.stream_stream(
            STREAM_METHOD,
            request_serializer=pb.GradientsRequest.SerializeToString,
            response_deserializer=identity,
        )
        self._replicas = replica_addresses(target)
        self._timeout = timeout
        self._chunk_bytes = chunk_bytes
        self._max_in_flight = max_in_flight
        self._micro_batch = micro_batch
        self._retries = retries
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="pergrad-client")
        self._infos: dict[str, ModelInfo] = {}
        self._replica_channels: list[grpc.Channel] = []

    def __enter__(self) -> GradientClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for channel in [self._channel, *self._replica_channels]:
            channel.close()

    def _replica_stubs(self) -> list[pb_grpc.GradientServiceStub]:
        """One stub per replica, for calls that must reach each of them."""
        if len(self._replicas) == 1:
            return [self._stub]
        if not self._replica_channels:
            self._replica_channels = [
                open_channel(a, self._options, self._security, replica_of=self._target)
                for a in self._replicas
            ]
        return [pb_grpc.GradientServiceStub(c) for c in self._replica_channels]

    @property
    def replicas(self) -> list[str]:
        """The server addresses the target names (resolved when the client was made)."""
        return list(self._replicas)

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

    def per_example_gradients(
        self,
        model: str,
        x: Any,
        y: Any,
        *,
        reduction: str = "none",
        variables: Sequence[str] | None = None,
        model_version: int = 0,
        wire_dtype: str | None = None,
        upcast: bool = False,
        out: GradientResult | None = None,
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
            wire_dtype: "float16" or "bfloat16" halves the bytes of full gradients;
                they arrive in that dtype, or as float32 with `upcast=True`.
            out: a previous result of the same call shape whose arrays are refilled
                in place (no fresh allocation of a large result in a loop).
        """
        x, y = np.asarray(x), np.asarray(y)
        size = self._micro_batch or len(x)
        starts = range(0, len(x), size) if len(x) else [0]
        calls = []
        for part, start in enumerate(starts):
            part_options = dict(options)
            if part and part_options.get("noise_multiplier"):
                part_options["noise_multiplier"] = 0.0  # a batch gets its noise once
            request = gradients_request(
                self._info(model),
                x[start : start + size],
                y[start : start + size],
                model_version=model_version,
                reduction=reduction,
                variables=variables,
                wire_dtype=wire_dtype,
                options=part_options,
            )
            calls.append(functools.partial(self._compute, request, timeout or self._timeout))
        if out is not None and len(calls) > 1:
            raise ValueError("out= refills one result; it does not combine with micro_batch")
        if len(calls) == 1:
            result = calls[0](out)
        else:
            result = merge([f.result() for f in [self._pool.submit(c) for c in calls]])
        return _upcast(result) if upcast else result

    def _compute(
        self,
        request: pb.GradientsRequest,
        timeout: float | None,
        out: GradientResult | None = None,
    ) -> GradientResult:
        """One call, sent again while its replica is gone and retries remain."""
        for attempt in range(self._retries + 1):
            try:
                responses = self._compute_call(request, timeout=timeout)
                results = [result for _, result in read_results(responses, out=out)]
            except grpc.RpcError as err:
                if err.code() in _RETRYABLE and attempt < self._retries:
                    continue
                raise PergradError(err.code(), err.details() or "") from None
            if len(results) != 1:
                raise PergradError(grpc.StatusCode.DATA_LOSS, f"{len(results)} results for one")
            return results[0]
        raise AssertionError("unreachable")

    def stream(
        self,
        model: str,
        batches: Iterable[tuple[Any, Any]],
        *,
        timeout: float | None = None,
        **kwargs: Any,
    ) -> Iterator[GradientResult]:
        """Results of many (x, y) batches, in order, with at most `max_in_flight` waiting.

        Takes the keywords of `per_example_gradients`. With one server, the batches
        share one StreamPerExampleGradients call; with several, each batch is its own
        call so that round_robin spreads them. `timeout` bounds the whole stream with
        one server (default: no deadline) and each batch with several.
        """
        if len(self._replicas) > 1 or self._micro_batch:
            return self._spread(model, batches, timeout=timeout, **kwargs)
        info = self._info(model)
        upcast = kwargs.pop("upcast", False)
        model_version = kwargs.pop("model_version", 0)
        reduction, variables = kwargs.pop("reduction", "none"), kwargs.pop("variables", None)
        wire_dtype = kwargs.pop("wire_dtype", None)

        def make_request(x: Any, y: Any, request_id: int) -> pb.GradientsRequest:
            return gradients_request(
                info,
                x,
                y,
                model_version=model_version,
                reduction=reduction,
                variables=variables,
                wire_dtype=wire_dtype,
                options=kwargs,
                request_id=request_id,
            )

        results = pipelined(
            self._stream_call,
            batches,
            make_request,
            max_in_flight=self._max_in_flight,
            timeout=timeout,
        )
        if not upcast:
            return results
        return (_upcast(r) for r in results)

    def _spread(
        self, model: str, batches: Iterable[tuple[Any, Any]], **kwargs: Any
    ) -> Iterator[GradientResult]:
        pending: deque[Future[GradientResult]] = deque()
        try:
            for x, y in batches:
                pending.append(self._pool.submit(self.per_example_gradients, model, x, y, **kwargs))
                if len(pending) >= self._max_in_flight:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()

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

    def set_weights(
        self,
        model: str,
        weights: Mapping[str, Any],
        *,
        expected_version: int = 0,
        timeout: float | None = None,
    ) -> int:
        """Replace every trainable variable at once, on every replica; returns the new version.

        With `expected_version`, the update applies only if that version is still
        current (FAILED_PRECONDITION otherwise), so concurrent writers cannot clobber
        each other. With several replicas they all get the same new version: one more
        than the highest any of them has. Arrays are cast to the variables' dtypes.
        """
        dtypes = {v.name: v.dtype for v in self._info(model).variables}
        arrays = {
            name: np.ascontiguousarray(value, dtype=dtypes.get(name))
            for name, value in weights.items()
        }
        replicas = self._replica_stubs()
        deadline = timeout or self._timeout
        new_version = 0
        if len(replicas) > 1:
            versions = self._on_all(
                replicas,
                lambda s: (
                    s.GetModelInfo(
                        pb.GetModelInfoRequest(model=model), timeout=deadline
                    ).model_version
                ),
            )
            new_version = max(versions) + 1

        def send(stub: pb_grpc.GradientServiceStub) -> int:
            messages = _weights_messages(
                model, arrays, expected_version, new_version, self._chunk_bytes
            )
            return stub.SetWeights(messages, timeout=deadline).model_version

        return max(self._on_all(replicas, send))

    def _on_all(
        self, stubs: list[pb_grpc.GradientServiceStub], fn: Callable[[Any], int]
    ) -> list[int]:
        """fn on every replica at once; an error names each replica that failed."""
        futures = [self._pool.submit(fn, stub) for stub in stubs]
        results, failures = [], []
        for address, future in zip(self._replicas, futures, strict=True):
            try:
                results.append(future.result())
            except grpc.RpcError as err:
                failures.append((address, err))
        if failures:
            code = failures[0][1].code()
            detail = "; ".join(f"{a}: {e.code().name} {e.details()}" for a, e in failures)
            raise PergradError(code, f"{len(failures)} of {len(stubs)} replicas failed: {detail}")
        return results


def _upcast(result: GradientResult) -> GradientResult:
    result.gradients = {k: g.astype(np.float32) for k, g in result.gradients.items()}
    return result


def _weights_messages(
    model: str,
    arrays: Mapping[str, np.ndarray],
    expected_version: int,
    new_version: int,
    chunk_bytes: int,
) -> Iterator[pb.WeightsMessage]:
    specs = [tensor_spec(name, array) for name, array in arrays.items()]
    yield pb.WeightsMessage(
        header=pb.WeightsHeader(
            model=model, model_version=expected_version, new_version=new_version, tensors=specs
        )
    )
    for index, array in enumerate(arrays.values()):
        for chunk in iter_chunks(index, array, chunk_bytes=chunk_bytes):
            yield pb.WeightsMessage(chunk=chunk)
