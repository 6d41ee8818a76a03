"""Many batches on one StreamPerExampleGradients call, pipelined with back-pressure."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from pergrad.client._results import read_results
from pergrad.client._types import GradientResult, PergradError
from pergrad.v1 import gradient_service_pb2 as pb


def pipelined(
    call: Callable[..., Any],
    batches: Iterable[tuple[Any, Any]],
    make_request: Callable[[Any, Any, int], pb.GradientsRequest],
    *,
    max_in_flight: int,
    timeout: float | None,
) -> Iterator[GradientResult]:
    """Results in request order; at most `max_in_flight` requests wait for theirs.

    Requests are built lazily in gRPC's sending thread; one that cannot be built (bad
    input) ends the request stream and its error is raised after the earlier results.
    """
    window = threading.Semaphore(max_in_flight)
    finished = threading.Event()
    failures: list[PergradError] = []

    def requests() -> Iterator[pb.GradientsRequest]:
        try:
            for request_id, (x, y) in enumerate(batches, start=1):
                while not window.acquire(timeout=0.1):
                    if finished.is_set():
                        return
                yield make_request(x, y, request_id)
        except PergradError as err:
            failures.append(err)

    responses = call(requests(), timeout=timeout)
    try:
        for expected_id, (request_id, result) in zip(itertools.count(1), read_results(responses)):
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
