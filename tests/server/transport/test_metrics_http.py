"""The /metrics endpoint on its own: what it answers, and that no client holds it."""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from pergrad.server.metrics import ServerMetrics
from pergrad.server.transport import metrics_http
from pergrad.server.transport.metrics_http import MetricsEndpoint, serve_metrics
from tests.prometheus import scrape


@pytest.fixture()
def endpoint() -> Iterator[MetricsEndpoint]:
    metrics = ServerMetrics()
    metrics.model_served("mnist_mlp", 1)
    served = serve_metrics(metrics, "127.0.0.1", 0)
    yield served
    served.close()


def _status(port: int, path: str, method: str = "GET") -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_metrics_are_served_in_the_text_format(endpoint: MetricsEndpoint) -> None:
    assert 'pergrad_weights_version{model="mnist_mlp"} 1.0' in scrape(endpoint.port)


def test_openmetrics_is_served_to_who_asks_for_it(endpoint: MetricsEndpoint) -> None:
    request = urllib.request.Request(
        f"http://127.0.0.1:{endpoint.port}/metrics",
        headers={"Accept": "application/openmetrics-text; version=1.0.0"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        assert response.read().decode().endswith("# EOF\n")


@pytest.mark.parametrize(
    ("path", "method", "status"), [("/", "GET", 404), ("/metrics", "POST", 405)]
)
def test_anything_but_get_metrics_is_refused(
    endpoint: MetricsEndpoint, path: str, method: str, status: int
) -> None:
    assert _status(endpoint.port, path, method) == status


def test_a_request_head_too_large_is_refused(endpoint: MetricsEndpoint) -> None:
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as connection:
        connection.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * metrics_http.MAX_HEAD_BYTES)
        assert connection.recv(100).startswith(b"HTTP/1.1 431")


def test_a_request_is_cut_off_at_its_deadline_however_it_trickles(
    endpoint: MetricsEndpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A byte every 0.1 s keeps every read short; the deadline is the request's."""
    monkeypatch.setattr(metrics_http, "REQUEST_TIMEOUT_S", 1.0)
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=10) as connection:
        while not _closed_by_peer(connection) and time.monotonic() - started < 5:
            time.sleep(0.1)
    assert 1.0 <= time.monotonic() - started < 3


def _closed_by_peer(connection: socket.socket) -> bool:
    """Sends one more byte of a request head; whether the endpoint has closed the
    connection."""
    try:
        connection.sendall(b"G")
        return connection.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True


def test_idle_connections_beyond_the_bound_never_lock_a_scraper_out(
    endpoint: MetricsEndpoint,
) -> None:
    """Three times MAX_CONNECTIONS connections that never send a byte: each new one makes
    room by closing the oldest, and a scrape gets in at once. They take no thread."""
    before = set(threading.enumerate())
    idle = [
        socket.create_connection(("127.0.0.1", endpoint.port))
        for _ in range(3 * metrics_http.MAX_CONNECTIONS)
    ]
    try:
        assert not set(threading.enumerate()) - before  # other tests' threads may end
        started = time.monotonic()
        assert "pergrad_weights_version" in scrape(endpoint.port)
        assert time.monotonic() - started < metrics_http.REQUEST_TIMEOUT_S
    finally:
        for connection in idle:
            connection.close()


def test_close_frees_the_port(endpoint: MetricsEndpoint) -> None:
    endpoint.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=5)
