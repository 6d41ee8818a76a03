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
from pergrad.wire.casting import rows
from pergrad.wire.chunked_requests import Whole
from pergrad.wire.results import ExpectedOutput, GradientResult


def pipelined(
    stream_call: Callable[..., Any],
    info: ModelInfo,
    call: Call,
    batches: Iterable[tuple[Any, Any]],
    max_in_flight: int,
) -> Iterator[GradientResult]:
    """Results in request order; at most `max_in_flight` batches wait for theirs. A batch
    one request cannot hold (the server's limits) goes as several, merged on arrival.

    Requests are built lazily in gRPC's sending thread; one that cannot be built (bad
    input) ends the request stream and its error is raised after the earlier results.
    """
    pipeline = _Pipeline(info, call, max_in_flight)
    responses = stream_call(pipeline.requests(batches), timeout=call.time_left())
    try:
        yield from pipeline.results(responses)
    except grpc.RpcError as err:
        raise from_rpc_error(err) from None
    finally:
        pipeline.finished.set()
        responses.cancel()
    if pipeline.failures:
        raise pipeline.failures[0]


class _Pipeline:
    """One stream's state, shared by gRPC's sending thread (`requests`) and the caller's
    (`results`): the window of batches in flight, each request's examples, each batch's
    number of requests."""

    def __init__(self, info: ModelInfo, call: Call, max_in_flight: int) -> None:
        self._info, self._call = info, call
        self._window = threading.Semaphore(max_in_flight)
        self.finished = threading.Event()
        self.failures: list[PergradError] = []
        self._sizes: dict[int, int] = {}
        self._parts_of_batches: deque[int] = deque()  # requests per batch, in order
        self._ids = itertools.count(1)

    def requests(self, batches: Iterable[tuple[Any, Any]]) -> Iterator[Whole]:
        try:
            for x, y in batches:
                while not self._window.acquire(timeout=0.1):
                    if self.finished.is_set():
                        return
                built = self._batch_requests(x, np.asarray(y))
                self._parts_of_batches.append(len(built))
                for request in built:
                    self._sizes[request.message.request_id] = request_examples(request)
                    yield request
        except PergradError as err:
            self.failures.append(err)

    def _batch_requests(self, x: Any, y: np.ndarray) -> list[Whole]:
        """One batch's requests: several where one request cannot hold it."""
        info, call = self._info, self._call
        parts = part_slices(rows_of(y), call.examples_per_request(info, x, y))
        if len(parts) > 1:
            x = batch_of(info, x, y)
        return [
            call.part(i).request(info, rows(x, part), y[part], request_id=next(self._ids))
            for i, part in enumerate(parts)
        ]

    def _expect(self, request_id: int) -> list[tuple[ExpectedOutput, np.dtype | None]]:
        if request_id not in self._sizes:
            raise data_loss(f"result for request {request_id}, which was not sent")
        return self._call.expected(self._info, self._sizes.pop(request_id))

    def results(self, responses: Iterator[bytes]) -> Iterator[GradientResult]:
        """Each batch's result, its parts merged, in order; each frees a window's place."""
        parts: list[GradientResult] = []
        for expected_id, (request_id, result) in zip(
            itertools.count(1), read_results(responses, self._expect)
        ):
            if request_id != expected_id:
                raise data_loss(f"result for request {request_id} arrived, expected {expected_id}")
            parts.append(result)
            if len(parts) < self._parts_of_batches[0]:
                continue
            self._parts_of_batches.popleft()
            self._window.release()
            yield parts[0] if len(parts) == 1 else merged(parts)
            parts = []
