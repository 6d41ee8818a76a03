"""A model's weights: read from one replica, written to every replica at once."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np

from pergrad.client._channels import Replicas
from pergrad.client._methods import Methods
from pergrad.client._types import ModelInfo, PergradError, answer_checked
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.codec import CodecError, TensorAssembler, iter_chunks, numpy_dtype, tensor_spec


def get_weights(
    call: grpc.UnaryStreamMultiCallable, info: ModelInfo, timeout: float | None
) -> tuple[pb.WeightsHeader, dict[str, np.ndarray]]:
    """(header, {variable: array}) from `call` (GetWeights, answering serialized
    messages); the header must list the model's variables, so that nothing is allocated
    beyond what its ModelInfo declared (and the client bounded)."""
    responses = call(pb.GetWeightsRequest(model=info.name), timeout=timeout)
    with answer_checked(f"weights of {info.name!r}: "):
        messages = (pb.WeightsMessage.FromString(m) for m in responses)
        first = next(messages, None)
        if first is None or not first.HasField("header"):
            raise CodecError("the answer does not start with a WeightsHeader")
        header = first.header
        declared = {(t.name, numpy_dtype(t.dtype), tuple(t.shape)) for t in header.tensors}
        known = {(v.name, v.dtype, tuple(v.shape)) for v in info.variables}
        if declared != known or len(header.tensors) != len(known):
            raise CodecError("weights do not match the model's variables")
        assembler = TensorAssembler(header.tensors)
        for message in messages:
            if not message.HasField("chunk"):
                raise CodecError("a second header where chunks were due")
            assembler.add(message.chunk)
        arrays = assembler.arrays()
    return header, {spec.name: array for spec, array in zip(header.tensors, arrays, strict=True)}


def _messages(
    header: pb.WeightsHeader, arrays: Mapping[str, np.ndarray], chunk_bytes: int
) -> Iterator[pb.WeightsMessage]:
    header.tensors.extend(tensor_spec(name, array) for name, array in arrays.items())
    yield pb.WeightsMessage(header=header)
    for index, array in enumerate(arrays.values()):
        for chunk in iter_chunks(index, array, chunk_bytes=chunk_bytes):
            yield pb.WeightsMessage(chunk=chunk)


class WeightsWriter:
    """SetWeights on every replica at once, with one common new version."""

    def __init__(self, replicas: Replicas, pool: ThreadPoolExecutor, chunk_bytes: int) -> None:
        self._replicas, self._pool, self._chunk_bytes = replicas, pool, chunk_bytes

    def set(
        self,
        info: ModelInfo,
        weights: Mapping[str, Any],
        *,
        expected_version: int,
        expected_id: str,
        timeout: float | None,
    ) -> tuple[int, str]:
        """(version, weights_id) of the new weights, the same on every replica."""
        dtypes = {v.name: v.dtype for v in info.variables}
        arrays = {
            name: np.ascontiguousarray(value, dtype=dtypes.get(name))
            for name, value in weights.items()
        }
        new_version = (
            self.next_version(info.name, timeout) if len(self._replicas.addresses) > 1 else 0
        )

        def send(methods: Methods) -> tuple[int, str]:
            header = pb.WeightsHeader(
                model=info.name,
                model_version=expected_version,
                weights_id=expected_id,
                new_version=new_version,
            )
            messages = _messages(header, arrays, self._chunk_bytes)
            reply = methods.stub.SetWeights(messages, timeout=timeout)
            return reply.model_version, reply.weights_id

        return max(self.on_all(send))

    def next_version(self, model: str, timeout: float | None) -> int:
        """One more than the highest version any replica has: the version an update
        gives them all."""
        request = pb.GetModelInfoRequest(model=model)
        versions = self.on_all(
            lambda m: m.stub.GetModelInfo(request, timeout=timeout).model_version
        )
        return max(versions) + 1

    def on_all(self, fn: Callable[[Methods], Any]) -> list[Any]:
        """fn on every replica's methods at once; an error names each replica that failed."""
        futures = [self._pool.submit(fn, methods) for methods in self._replicas.methods()]
        results, failures = [], []
        for address, future in zip(self._replicas.addresses, futures, strict=True):
            try:
                results.append(future.result())
            except grpc.RpcError as err:
                failures.append((address, err))
        if failures:
            code = failures[0][1].code()
            detail = "; ".join(f"{a}: {e.code().name} {e.details()}" for a, e in failures)
            failed = f"{len(failures)} of {len(futures)} replicas failed"
            raise PergradError(code, f"{failed}: {detail}")
        return results
