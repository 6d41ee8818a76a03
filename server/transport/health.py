"""The standard grpc.health.v1 service, with Watch streams that hold no worker thread and
end when the server stops serving.

grpcio-health-checking's servicer keeps every Watch stream open through a drain, so
`server.stop(grace)` waits out the whole grace period for any open watcher. Here a Watch
registers a callback and returns at once (gRPC's non-blocking streaming handlers), and
`stop_serving` sends NOT_SERVING to every watcher and then ends its stream with OK.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pergrad.server.transport.grpc_private import non_blocking

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

# Sends one response on a Watch stream; None ends the stream.
Send = Callable[[health_pb2.HealthCheckResponse | None], None]


class _Watcher:
    """One Watch stream. Its sends are serialized by its own lock, never the servicer's:
    gRPC's thread ending a cancelled Watch takes the servicer's lock (`_forget`) while it
    holds the call's, which a send needs, so a send under the servicer's lock deadlocks."""

    def __init__(self, service: str, send: Send) -> None:
        self.service = service
        self._send = send
        self._lock = threading.Lock()
        self._ended = False

    def tell(self, status: Callable[[], int], *, end: bool = False) -> None:
        """Send the status read at sending time (so the last one sent is the latest, whatever
        order concurrent callers run in); with `end`, then end the stream."""
        with self._lock:
            if self._ended:
                return
            self._send(health_pb2.HealthCheckResponse(status=status()))
            if end:
                self._ended = True
                self._send(None)


class HealthService(health_pb2_grpc.HealthServicer):
    """Serving status per service name ("" is the whole server). No response is sent while
    `_lock` is held (see `_Watcher`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: dict[str, int] = {}
        self._watchers: dict[str, set[_Watcher]] = {}
        self._stopped = False

    def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        with self._lock:
            status = self._status.get(request.service)
        if status is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext, send: Send
    ) -> None:
        watcher = _Watcher(request.service, send)
        with self._lock:
            stopped = self._stopped
            if not stopped:
                self._watchers.setdefault(watcher.service, set()).add(watcher)
        if not stopped and not context.add_callback(lambda: self._forget(watcher)):
            self._forget(watcher)  # the call has ended already
        watcher.tell(lambda: self._status_of(watcher.service), end=stopped)

    def _status_of(self, service: str) -> int:
        with self._lock:
            return self._status.get(service, SERVICE_UNKNOWN)

    def _forget(self, watcher: _Watcher) -> None:
        with self._lock:
            self._watchers.get(watcher.service, set()).discard(watcher)

    def set(self, service: str, status: int) -> None:
        """Set `service`'s status and tell its watchers; ignored once stopped."""
        with self._lock:
            if self._stopped:
                return
            self._status[service] = status
            watchers = list(self._watchers.get(service, ()))
        for watcher in watchers:
            watcher.tell(lambda: self._status_of(service))

    def stop_serving(self) -> None:
        """Every service NOT_SERVING for good; every Watch stream told so, then ended."""
        with self._lock:
            self._stopped = True
            for service in self._status:
                self._status[service] = NOT_SERVING
            watchers = [w for group in self._watchers.values() for w in group]
            self._watchers.clear()
        for watcher in watchers:
            watcher.tell(functools.partial(self._status_of, watcher.service), end=True)


# gRPC calls a non-blocking handler with a `send` callback and frees the worker at once.
non_blocking(HealthService.Watch)
