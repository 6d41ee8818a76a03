"""The HTTP endpoint that exposes a server's metrics registry at /metrics.

One event loop on a thread of its own serves every connection: an open connection costs a
coroutine, never a thread. Slow and hostile clients cannot starve a scraper:
- a request must arrive whole within REQUEST_TIMEOUT_S of its connection opening (a
  deadline per request, not per read: a client sending a byte at a time is cut off at it),
  and its answer must be taken within the same time;
- at most MAX_CONNECTIONS are open at once; one more closes the oldest connection still
  sending its request, so new connections (a scraper's) always get in;
- a request head over MAX_HEAD_BYTES is refused. One request per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from pergrad.server.metrics import ServerMetrics

_LOGGER = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64
MAX_HEAD_BYTES = 16 * 1024

_Response = tuple[str, str, bytes]


def _answer(head: bytes, registry: CollectorRegistry) -> _Response:
    """(status, content type, body) for a request head."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        return "400 Bad Request", "text/plain", b"bad request line\n"
    method, target, _ = parts
    if target.split("?", 1)[0] != "/metrics":
        return "404 Not Found", "text/plain", b"only /metrics is served here\n"
    if method not in ("GET", "HEAD"):
        return "405 Method Not Allowed", "text/plain", b"GET /metrics\n"
    headers = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
    accept = next((v.strip() for k, v in headers.items() if k.strip().lower() == "accept"), "")
    encoder, content_type = choose_encoder(accept)
    body = encoder(registry)
    return "200 OK", content_type, b"" if method == "HEAD" else body


def _response(status: str, content_type: str, body: bytes) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("latin-1") + body


class MetricsEndpoint:
    """Serves one registry at http://host:port/metrics until `close`."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self._registry = registry
        self._loop = asyncio.new_event_loop()
        self._connections: set[asyncio.Task] = set()
        self._reading: OrderedDict[asyncio.Task, None] = OrderedDict()  # oldest first
        bound: Future[int] = Future()
        self.thread = threading.Thread(
            target=self._run, args=(host, port, bound), name="metrics", daemon=True
        )
        self.thread.start()
        self.port = bound.result()

    def _run(self, host: str, port: int, bound: Future[int]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            start = asyncio.start_server(self._serve, host, port, limit=MAX_HEAD_BYTES)
            server = self._loop.run_until_complete(start)
        except OSError as err:
            bound.set_exception(OSError(f"cannot bind the metrics endpoint {host}:{port}: {err}"))
            self._loop.close()
            return
        bound.set_result(server.sockets[0].getsockname()[1])
        try:
            self._loop.run_forever()
        finally:
            server.close()
            for task in self._connections:
                task.cancel()
            self._loop.run_until_complete(
                asyncio.gather(server.wait_closed(), *self._connections, return_exceptions=True)
            )
            self._loop.close()

    def _admit(self, task: asyncio.Task) -> None:
        """Make room for `task`: close the oldest connection still sending its request."""
        if len(self._connections) >= MAX_CONNECTIONS and self._reading:
            oldest, _ = self._reading.popitem(last=False)
            oldest.cancel()
        self._connections.add(task)
        self._reading[task] = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._admit(task)
        try:
            await asyncio.wait_for(self._exchange(task, reader, writer), REQUEST_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.CancelledError, OSError):
            _LOGGER.debug("metrics connection closed before its answer", exc_info=True)
            writer.transport.abort()
        finally:
            self._reading.pop(task, None)
            self._connections.discard(task)

    async def _exchange(
        self, task: asyncio.Task, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Read one request head, answer it, and close once the answer is taken."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            response = _response(*_answer(head, self._registry))
        except asyncio.LimitOverrunError:
            response = _response("431 Request Header Fields Too Large", "text/plain", b"")
        self._reading.pop(task, None)
        writer.write(response)
        writer.close()
        await writer.wait_closed()

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: closed already
            self._loop.call_soon_threadsafe(self._loop.stop)
        self.thread.join(timeout=5)


def serve_metrics(metrics: ServerMetrics, host: str, port: int) -> MetricsEndpoint:
    """Serve `metrics` over HTTP at http://host:port/metrics (port 0 picks a free one)."""
    endpoint = MetricsEndpoint(metrics.registry, host, port)
    _LOGGER.debug("metrics on %s:%d", host, endpoint.port)
    return endpoint
