"""Many batches on one StreamPerExampleGradients call, pipelined with back-pressure."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from pergrad.client._call import Call
from pergrad.client._receive import read_results
from pergrad.client._types import ModelInfo, PergradError, data_loss, from_rpc_error
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.results import GradientResult


def pipelined(
    stream_call: Callable[..., Any],
    info: ModelInfo,
    call: Call,
    batches: Iterable[tuple[Any, Any]],
    *,
    max_in_flight: int,
) -> Iterator[GradientResult]:
    """Results in request order; at most `max_in_flight` requests wait for theirs.

    Requests are built lazily in gRPC's sending thread; one that cannot be built (bad
    input) ends the request stream and its error is raised after the earlier results.
    """
    window = threading.Semaphore(max_in_flight)
    finished = threading.Event()
    failures: list[PergradError] = []
    sizes: dict[int, int] = {}

    def requests() -> Iterator[pb.GradientsRequest]:
        try:
            for request_id, (x, y) in enumerate(batches, start=1):
                while not window.acquire(timeout=0.1):
                    if finished.is_set():
                        return
                request = call.request(info, x, y, request_id=request_id)
                sizes[request_id] = int(request.labels.shape[0]) if request.labels.shape else 0
                yield request
        except PergradError as err:
            failures.append(err)

    def expect(request_id: int):
        if request_id not in sizes:
            raise data_loss(f"result for request {request_id}, which was not sent")
        return call.expected(info, sizes.pop(request_id))

    responses = stream_call(requests(), timeout=call.timeout)
    try:
        results = read_results(responses, expect)
        for expected_id, (request_id, result) in zip(itertools.count(1), results):
            if request_id != expected_id:
                raise data_loss(f"result for request {request_id} arrived, expected {expected_id}")
            window.release()
            yield result
    except grpc.RpcError as err:
        raise from_rpc_error(err) from None
    finally:
        finished.set()
        responses.cancel()
    if failures:
        raise failures[0]
