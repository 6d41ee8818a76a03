"""The standard grpc.health.v1 service, with Watch streams that hold no worker thread and
end when the server stops serving.

grpcio-health-checking's servicer keeps every Watch stream open through a drain, so
`server.stop(grace)` waits out the whole grace period for any open watcher. Here a Watch
registers a callback and returns at once (gRPC's non-blocking streaming handlers), and
`stop_serving` sends NOT_SERVING to every watcher and then ends its stream with OK.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

# Sends one response on a Watch stream; None ends the stream.
Send = Callable[[health_pb2.HealthCheckResponse | None], None]


class HealthService(health_pb2_grpc.HealthServicer):
    """Serving status per service name ("" is the whole server)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: dict[str, int] = {}
        self._watchers: dict[str, set[Send]] = {}
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
        service = request.service
        with self._lock:
            send(health_pb2.HealthCheckResponse(status=self._status.get(service, SERVICE_UNKNOWN)))
            if self._stopped:
                send(None)
                return
            self._watchers.setdefault(service, set()).add(send)
        context.add_callback(lambda: self._forget(service, send))

    def _forget(self, service: str, send: Send) -> None:
        with self._lock:
            self._watchers.get(service, set()).discard(send)

    def set(self, service: str, status: int) -> None:
        """Set `service`'s status and tell its watchers; ignored once stopped."""
        with self._lock:
            if self._stopped:
                return
            self._status[service] = status
            for send in self._watchers.get(service, ()):
                send(health_pb2.HealthCheckResponse(status=status))

    def stop_serving(self) -> None:
        """Every service NOT_SERVING for good; every Watch stream told so, then ended."""
        with self._lock:
            self._stopped = True
            for service in self._status:
                self._status[service] = NOT_SERVING
            ends = [
                (send, self._status.get(service, SERVICE_UNKNOWN))
                for service, watchers in self._watchers.items()
                for send in watchers
            ]
            self._watchers.clear()
        # Sent outside the lock: a Watch cancelled meanwhile takes the lock from gRPC's
        # thread to leave, while gRPC holds the call's own lock that `send` needs.
        for send, status in ends:
            send(health_pb2.HealthCheckResponse(status=status))
            send(None)


# gRPC calls a non-blocking handler with a `send` callback and frees the worker at once.
HealthService.Watch.experimental_non_blocking = True
