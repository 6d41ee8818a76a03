"""Measuring one gradients request while its response messages pass through: queue time
from the call's arrival, compute time (waiting for each message), serialize time (gRPC
holding each one), response bytes and examples in flight, into `ServerMetrics`."""

from __future__ import annotations

import time
from collections.abc import Iterator

import grpc

from pergrad.server.metrics import ServerMetrics
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.catalogue import CATALOGUE, OptionError


def reduction_label(request: pb.GradientsRequest) -> str:
    """The reduction label: "none", "norms", ... as the catalogue names them."""
    try:
        return CATALOGUE.by_number(request.reduction).name
    except OptionError:  # a value newer than this server's wire contract
        return "unknown"


def tracked(
    metrics: ServerMetrics,
    request: pb.GradientsRequest,
    responses: Iterator[pb.GradientsResponse | bytes],
    context: grpc.ServicerContext,
) -> Iterator[pb.GradientsResponse | bytes]:
    """The `responses` to `request`, passed through while they are measured.

    Queue time runs from the call's arrival (its first request) or from now (a later
    request of a stream); compute is the time the handler waits for each response
    message, serialize the time gRPC holds each one before asking for the next.
    """
    arrived = metrics.take_arrival() or time.perf_counter()
    return _Tracker(metrics, reduction_label(request)).run(responses, context, arrived)


class _Tracker:
    def __init__(self, metrics: ServerMetrics, reduction: str) -> None:
        self._metrics = metrics
        self._reduction = reduction
        self._compute_s = 0.0
        self._serialize_s = 0.0
        self._header: pb.ResultHeader | None = None

    def run(
        self,
        responses: Iterator[pb.GradientsResponse | bytes],
        context: grpc.ServicerContext,
        arrived: float,
    ) -> Iterator[pb.GradientsResponse | bytes]:
        self._metrics.request_started(time.perf_counter() - arrived)
        complete = False
        try:
            for message in self._timed(responses):
                self._count(message)
                started = time.perf_counter()
                yield message
                self._serialize_s += time.perf_counter() - started
            complete = context.is_active()
        finally:
            self._metrics.request_ended()
            self._finish(complete)

    def _timed(
        self, responses: Iterator[pb.GradientsResponse | bytes]
    ) -> Iterator[pb.GradientsResponse | bytes]:
        while True:
            started = time.perf_counter()
            message = next(responses, None)
            self._compute_s += time.perf_counter() - started
            if message is None:
                return
            yield message

    def _count(self, message: pb.GradientsResponse | bytes) -> None:
        """Response bytes; a pre-encoded chunk message (`pergrad.wire.chunks`) is bytes."""
        if isinstance(message, bytes):
            size = len(message)
        else:
            if self._header is None and message.HasField("header"):
                self._header = message.header
                self._metrics.examples_started(self._header.batch_size)
            size = message.ByteSize()
        if self._header is not None:
            self._metrics.response_sent(self._header.model, size)

    def _finish(self, complete: bool) -> None:
        header = self._header
        if header is None:  # refused before any result: only the queue time is known
            return
        self._metrics.examples_ended(
            header.model,
            self._reduction,
            header.batch_size,
            compute_s=self._compute_s,
            serialize_s=self._serialize_s,
            complete=complete,
        )
