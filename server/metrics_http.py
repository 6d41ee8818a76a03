"""The HTTP endpoint that exposes a server's metrics registry at /metrics.

Bounded against idle and hostile connections: each connection gets CONNECTION_TIMEOUT_S
to send its request and read the answer, and at most MAX_CONNECTIONS are served at once;
one more is closed at once instead of taking a thread.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from pergrad.server.metrics import ServerMetrics

_LOGGER = logging.getLogger(__name__)


@dataclass
class MetricsEndpoint:
    """The HTTP server that exposes one registry at /metrics."""

    httpd: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.httpd.server_port

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


CONNECTION_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 16


class _QuietHandler(WSGIRequestHandler):
    timeout = CONNECTION_TIMEOUT_S  # StreamRequestHandler sets it on the socket

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds would drown the server's log."""


class _BoundedServer(ThreadingWSGIServer):
    """A thread per connection, at most MAX_CONNECTIONS threads; quiet about timeouts."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        _LOGGER.debug("metrics connection from %s failed", client_address, exc_info=True)


def serve_metrics(metrics: ServerMetrics, host: str, port: int) -> MetricsEndpoint:
    """Serve `metrics` over HTTP at http://host:port/metrics (port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("MetricsServer", (_BoundedServer,), {"address_family": family})
    try:
        httpd = make_server(
            host, port, make_wsgi_app(metrics.registry), server_class, _QuietHandler
        )
    except OSError as err:
        raise OSError(f"cannot bind the metrics endpoint {host}:{port}: {err}") from err
    # A short poll interval lets close() return at once instead of after up to 0.5 s.
    thread = threading.Thread(
        target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="metrics", daemon=True
    )
    thread.start()
    _LOGGER.debug("metrics on %s:%d", host, httpd.server_port)
    return MetricsEndpoint(httpd, thread)
