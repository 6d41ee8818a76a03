"""The HTTP endpoint that exposes a server's metrics registry at /metrics."""

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


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes every few seconds would drown the server's log."""


def serve_metrics(metrics: ServerMetrics, host: str, port: int) -> MetricsEndpoint:
    """Serve `metrics` over HTTP at http://host:port/metrics (port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
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
