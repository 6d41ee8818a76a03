"""Many batches on one StreamPerExampleGradients call, pipelined with back-pressure."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
import numpy as np

from pergrad.client._call import Call, batch_of, request_examples, rows_of
from pergrad.client._receive import read_results
from pergrad.client._spread import merged, part_slices
from pergrad.client._types import ModelInfo, PergradError, data_loss, from_rpc_error
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.casting import rows
from pergrad.wire.results import ExpectedOutput, GradientResult


def pipelined(
    stream_call: Callable[..., Any],
    info: ModelInfo,
    call: Call,
    batches: Iterable[tuple[Any, Any]],
    *,
    max_in_flight: int,
) -> Iterator[GradientResult]:
    """Results in request order; at most `max_in_flight` batches wait for theirs. A batch
    one request cannot hold (the server's limits) goes as several, merged on arrival.

    Requests are built lazily in gRPC's sending thread; one that cannot be built (bad
    input) ends the request stream and its error is raised after the earlier results.
    """
    window = threading.Semaphore(max_in_flight)
    finished = threading.Event()
    failures: list[PergradError] = []
    sizes: dict[int, int] = {}
    parts_of_batches: deque[int] = deque()  # requests per batch, in order

    def requests() -> Iterator[pb.GradientsRequest]:
        request_ids = itertools.count(1)
        try:
            for x, y in batches:
                while not window.acquire(timeout=0.1):
                    if finished.is_set():
                        return
                y = np.asarray(y)
                size = call.examples_per_request(info, x, y)
                parts = part_slices(rows_of(y), size)
                if len(parts) > 1:
                    x = batch_of(info, x, y)
                built = [
                    call.part(i).request(info, rows(x, part), y[part], request_id=next(request_ids))
                    for i, part in enumerate(parts)
                ]
                parts_of_batches.append(len(built))
                for request in built:
                    sizes[request.request_id] = request_examples(request)
                    yield request
        except PergradError as err:
            failures.append(err)

    def expect(request_id: int) -> list[tuple[ExpectedOutput, np.dtype | None]]:
        if request_id not in sizes:
            raise data_loss(f"result for request {request_id}, which was not sent")
        return call.expected(info, sizes.pop(request_id))

    responses = stream_call(requests(), timeout=call.timeout)
    try:
        results = read_results(responses, expect)
        parts: list[GradientResult] = []
        for expected_id, (request_id, result) in zip(itertools.count(1), results):
            if request_id != expected_id:
                raise data_loss(f"result for request {request_id} arrived, expected {expected_id}")
            parts.append(result)
            if len(parts) < parts_of_batches[0]:
                continue
            parts_of_batches.popleft()
            window.release()
            yield parts[0] if len(parts) == 1 else merged(parts)
            parts = []
    except grpc.RpcError as err:
        raise from_rpc_error(err) from None
    finally:
        finished.set()
        responses.cancel()
    if failures:
        raise failures[0]
