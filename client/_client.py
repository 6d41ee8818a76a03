"""GradientClient: per-example gradients and weights of models served by pergrad."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from pergrad.client._call import Call, batch_of, rows_of
from pergrad.client._channels import Replicas, open_channel
from pergrad.client._credentials import Security
from pergrad.client._known import Known
from pergrad.client._methods import Methods
from pergrad.client._spread import check_versions, computed, micro_batched, spread
from pergrad.client._steps import StepResult, on_all, on_one, step_call, step_request
from pergrad.client._stream import pipelined
from pergrad.client._types import MAX_MODEL_BYTES, ModelInfo, rpc_errors
from pergrad.client._weights import WeightsWriter, get_weights
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.codec import DEFAULT_CHUNK_BYTES
from pergrad.wire.results import GradientResult, side_by_side

DEFAULT_TIMEOUT_S = 120.0


class GradientClient:
    """Talks to one pergrad server, or spreads work over several.

    Args:
        target: "host:port"; "ipv4:h1:50051,h2:50051" for a fixed list of replicas;
            "dns:///name:50051" for every address of a name (a Kubernetes headless
            Service). gRPC's round_robin policy spreads calls over the replicas.
        security: TLS, client certificates and a token (`Security`); plaintext without.
            Its fields may be given as keywords instead (`tls=True`, `token=`, ...: the
            fields of `Security.of`).
        timeout: default deadline in seconds for each call, its retries included.
        chunk_bytes: size of the chunks `set_weights` sends.
        max_in_flight: batches `stream` keeps on the wire before waiting for results.
        micro_batch: split a batch into micro-batches of this many examples, computed
            concurrently (on several replicas) and reassembled in order. A batch is
            split anyway where one request could not hold it (the server's limits).
        retries: times a call that found its replica gone is sent again.
        max_model_bytes: the most bytes a model's variables may declare (16 GiB): a
            server declaring more, or answering anything malformed, is not believed
            (PergradError with DATA_LOSS).
        options: extra gRPC channel options.
    """

    def __init__(
        self,
        target: str,
        *,
        security: Security | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_in_flight: int = 2,
        micro_batch: int | None = None,
        retries: int = 2,
        max_model_bytes: int = MAX_MODEL_BYTES,
        options: Iterable[tuple[str, Any]] = (),
        **credentials: Any,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if micro_batch is not None and micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        if security is not None and credentials:
            raise ValueError(f"give security= or {sorted(credentials)}, not both")
        security = security or Security.of(**credentials)
        self._channel = open_channel(target, list(options), security)
        self._methods = Methods(self._channel)
        self._replicas = Replicas(target, list(options), security, self._methods)
        self._known = Known(self._methods, max_model_bytes)
        self._timeout, self._retries = timeout, retries
        self._max_in_flight, self._micro_batch = max_in_flight, micro_batch
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="pergrad-client")
        # The parts of one call, apart from the calls `stream` spreads over `_pool`: a
        # call on a pool thread waits for its parts, which must not wait for it.
        self._parts = ThreadPoolExecutor(max_workers=8, thread_name_prefix="pergrad-parts")
        self._writer = WeightsWriter(self._replicas, self._pool, chunk_bytes)

    def __enter__(self) -> GradientClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for pool in (self._pool, self._parts):
            pool.shutdown(wait=False, cancel_futures=True)
        self._channel.close()
        self._replicas.close()

    @property
    def replicas(self) -> list[str]:
        """The server addresses the target names (`Replicas.addresses`)."""
        return list(self._replicas.addresses)

    @rpc_errors
    def list_models(self, *, timeout: float | None = None) -> list[str]:
        reply = self._methods.stub.ListModels(
            pb.ListModelsRequest(), timeout=timeout or self._timeout
        )
        return list(reply.models)

    @rpc_errors
    def model_info(self, model: str, *, timeout: float | None = None) -> ModelInfo:
        return self._known.fetch(model, timeout or self._timeout)

    def _call(self, model: str, **call: Any) -> Call:
        return self._known.pinned(Call.of(model, **call))

    @rpc_errors
    def _info(self, model: str) -> ModelInfo:
        return self._known.info(model, self._timeout)

    def per_example_gradients(
        self,
        model: str,
        x: Any,
        y: Any,
        *,
        out: GradientResult | None = None,
        timeout: float | None = None,
        **call: Any,
    ) -> GradientResult:
        """Per-example losses [B] and gradients {variable: [B, *shape]} of one batch,
        or a server-side reduction of them. `x` is one array [B, ...], or for a model of
        several inputs a mapping from their names (`model_info().inputs`) to arrays (or
        a list in the model's order); `y` the labels [B, ...].

        Keywords:
            reduction: "none" (full gradients), "norms", "clipped_sum" (options
                max_norm, noise_multiplier, seed), "moments", "dot" (reference:
                {variable: [K, *shape]}) or "project" (dim, seed, kind="rademacher" or
                "gaussian"); `pergrad.wire.catalogue` holds every option and output.
            variables: restrict any reduction to these variables.
            model_version: pin the weights: FAILED_PRECONDITION unless it is current (and
                unless they are the weights this client saw under it, if it did).
            weights_id: pin the weights by content (`result.weights_id`,
                `model_info().weights_id`), whatever their version.
            wire_dtype: ("none") "float16" or "bfloat16" halves the bytes of full
                gradients; they arrive in that dtype, or as float32 with `upcast=True`.
                float16 holds magnitudes below 65520: a result past it is refused
                (FAILED_PRECONDITION), never sent as infinity.
            out: a previous result of the same call shape whose arrays are refilled
                in place (no fresh allocation of a large result in a loop).

        A batch larger than one request may hold (the server's `max_batch`, or
        `max_request_bytes` in `model_info().limits`) is sent in parts, as `micro_batch`
        sends it, and merged in order; a `dot` whose references leave no room for an
        example sends them a few rows at a time (the batch's gradients computed once per
        part) and puts the parts' dots side by side.
        """
        request = self._call(model, timeout=timeout or self._timeout, **call)
        y, parts = np.asarray(y), request.reference_parts(self._info(model))
        if len(parts) > 1:
            results = [self._batch(part, x, y) for part in parts]
            check_versions(results)
            result = side_by_side(results, into=out)
        else:
            result = self._batch(request, x, y, out=out)
        self._known.seen(model, result.model_version, result.weights_id)
        return request.delivered(result)

    def _batch(
        self, call: Call, x: Any, y: np.ndarray, out: GradientResult | None = None
    ) -> GradientResult:
        """One call's result, its batch in micro-batches where one request cannot hold it."""
        info = self._info(call.model)
        size = call.examples_per_request(info, x, y)
        size = min(size, self._micro_batch or size)
        if rows_of(y) > size:
            x = batch_of(info, x, y)
            return micro_batched(self._compute, self._parts, call, x, y, size, out=out)
        return self._compute(call, x, y, out=out)

    def _compute(
        self, call: Call, x: Any, y: Any, out: GradientResult | None = None
    ) -> GradientResult:
        info = self._info(call.model)
        return computed(
            self._methods.compute,
            info,
            call,
            call.request(info, x, y),
            retries=self._retries,
            out=out,
        )

    def stream(
        self,
        model: str,
        batches: Iterable[tuple[Any, Any]],
        *,
        timeout: float | None = None,
        **call: Any,
    ) -> Iterator[GradientResult]:
        """Results of many (x, y) batches, in order, with at most `max_in_flight` waiting.

        Takes the keywords of `per_example_gradients`. With one server, the batches
        share one StreamPerExampleGradients call (a batch larger than one request may
        hold goes as several of its requests); with several, or with `micro_batch`, or a
        `dot` whose references go in parts, each batch is its own call (so that
        round_robin spreads them). `timeout` bounds the whole stream in the first case
        (default: no deadline) and each batch in the others.
        """
        request, info = self._call(model, timeout=timeout, **call), self._info(model)
        in_parts = len(request.reference_parts(info)) > 1
        if len(self._replicas.addresses) > 1 or self._micro_batch or in_parts:
            compute = functools.partial(self.per_example_gradients, model, timeout=timeout, **call)
            return spread(self._pool, compute, batches, self._max_in_flight)
        results = pipelined(self._methods.stream, info, request, batches, self._max_in_flight)
        return (request.delivered(r) for r in results) if request.upcast else results

    @rpc_errors
    def get_weights(
        self, model: str, *, timeout: float | None = None
    ) -> tuple[int, dict[str, np.ndarray]]:
        """(version, {variable: array}) of the model's current weights."""
        info = self._info(model)
        header, arrays = get_weights(self._methods.weights, info, timeout or self._timeout)
        self._known.seen(model, header.model_version, header.weights_id)
        return header.model_version, arrays

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
        version, weights_id = self._writer.set(
            self._info(model),
            weights,
            expected_version=expected_version,
            expected_id=self._known.id_of(model, expected_version),
            timeout=timeout or self._timeout,
        )
        self._known.seen(model, version, weights_id)
        return version

    @rpc_errors
    def step(
        self,
        model: str,
        x: Any,
        y: Any,
        *,
        learning_rate: float,
        expected_batch_size: float = 0,
        reduction: str = "clipped_sum",
        model_version: int = 0,
        timeout: float | None = None,
        **options: Any,
    ) -> StepResult:
        """One training step on the server: the batch's gradient sum, divided by
        `expected_batch_size` (0: the batch's size, a mean), applied by the server's
        optimizer (`model_info().optimizer`); returns the new version and the batch's
        losses, norms and num_clipped. The weights never cross the wire.

        reduction "clipped_sum" is DP-SGD (options max_norm, noise_multiplier, seed; no
        seed: fresh noise from the server's secure source); "moments" applies the plain
        sum. `model_version` pins the step to those weights (FAILED_PRECONDITION
        otherwise). With several replicas the sum is computed once (spread over them
        with `micro_batch`) and every replica applies it with one new version, once
        all of them have answered that they are up; a replica that fails is named in
        the error (one failing as it applies leaves the others stepped: `set_weights`
        on all brings them level, starting every optimizer afresh). A batch larger than
        one request may hold is computed in parts, as on several replicas.

        A step is sent again while its server is unavailable (`retries`), with the id
        it was first sent with: a server that applied it answers as it did then.
        """
        options.update(reduction=reduction, model_version=model_version)
        call = self._call(model, timeout=timeout or self._timeout, **options)
        batch = step_call(call)  # refused here, before any replica computes
        step = step_request(call, learning_rate, expected_batch_size)
        info, y = self._info(model), np.asarray(y)
        in_one_request = batch.examples_per_request(info, x, y) >= rows_of(y)
        if len(self._replicas.addresses) == 1 and in_one_request:
            done = on_one(self._methods.step, info, batch, x, y, step, self._retries)
        else:
            left = call.time_left()  # the gradients, then the step on every replica
            result = self.per_example_gradients(model, x, y, timeout=left, **options)
            step.model_version = 0
            done = on_all(self._writer, info, result, call, step, self._retries)
        self._known.seen(model, done.model_version, done.weights_id)
        return done
