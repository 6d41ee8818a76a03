"""The metrics interceptor on a real gRPC server: every kind of RPC, every way one ends.

A small bytes-in, bytes-out service on 127.0.0.1 stands in for handlers that succeed,
abort, raise, fail mid-stream or are cancelled by the client.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import NamedTuple

import grpc
import pytest

from pergrad.server.metrics import ServerMetrics
from pergrad.server.transport.grpc_private import non_blocking
from pergrad.server.transport.interceptors import MetricsInterceptor

SERVICE = "test.Probe"


def _unary(request: bytes, context: grpc.ServicerContext) -> bytes:
    if request == b"abort":
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused")
    if request == b"raise":
        raise RuntimeError("handler bug")
    if request == b"set-code":
        context.set_code(grpc.StatusCode.NOT_FOUND)
    return request


def _server_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    for index in range(3 if request != b"forever" else 10**9):
        if index == 2 and request == b"raise":
            raise RuntimeError("failed mid-stream")
        if index == 2 and request == b"abort":
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "out of memory mid-stream")
        if request == b"forever":
            time.sleep(0.01)
        yield b"x"


def _client_stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    return b"%d" % sum(1 for _ in requests)


def _bidi_stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    yield from requests


@pytest.fixture(scope="module")
def probe() -> Iterator[tuple[grpc.Channel, ServerMetrics]]:
    metrics = ServerMetrics()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), interceptors=[MetricsInterceptor(metrics)]
    )
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "ServerStream": grpc.unary_stream_rpc_method_handler(_server_stream),
        "ClientStream": grpc.stream_unary_rpc_method_handler(_client_stream),
        "BidiStream": grpc.stream_stream_rpc_method_handler(_bidi_stream),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel, metrics
    server.stop(0)


def _value(metrics: ServerMetrics, name: str, method: str, grpc_type: str, **labels: str) -> float:
    labels = {"grpc_type": grpc_type, "grpc_service": SERVICE, "grpc_method": method, **labels}
    return metrics.registry.get_sample_value(name, labels) or 0.0


class _Delta:
    """Changes of one method's metrics across a block."""

    NAMES = (
        "grpc_server_started_total",
        "grpc_server_msg_received_total",
        "grpc_server_msg_sent_total",
        "grpc_server_handling_seconds_count",
    )

    def __init__(self, metrics: ServerMetrics, method: str, grpc_type: str) -> None:
        self._args = (method, grpc_type)
        self._metrics = metrics
        self._before = self._read()

    def _read(self) -> dict[str, float]:
        values = {name: _value(self._metrics, name, *self._args) for name in self.NAMES}
        for code in grpc.StatusCode:
            handled = _value(
                self._metrics, "grpc_server_handled_total", *self._args, grpc_code=code.name
            )
            values[code.name] = handled
        return values

    def changes(self) -> dict[str, float]:
        after = self._read()
        return {k: after[k] - v for k, v in self._before.items() if after[k] != v}

    def wait_for(self, key: str, *, timeout_s: float = 10.0) -> dict[str, float]:
        """Changes once `key` changed: a cancelled call is handled when gRPC lets it go."""
        deadline = time.monotonic() + timeout_s
        while key not in self.changes() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.changes()


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"ok", "OK"),
        (b"abort", "INVALID_ARGUMENT"),
        (b"raise", "UNKNOWN"),
        (b"set-code", "NOT_FOUND"),
    ],
)
def test_unary_call_is_counted_once_with_the_code_the_client_sees(probe, payload, code) -> None:
    channel, metrics = probe
    delta = _Delta(metrics, "Unary", "unary")
    try:
        channel.unary_unary(f"/{SERVICE}/Unary")(payload, timeout=10)
        seen = "OK"
    except grpc.RpcError as err:
        seen = err.code().name
    assert seen == code
    sent = {"grpc_server_msg_sent_total": 1.0} if code in ("OK", "NOT_FOUND") else {}
    assert delta.changes() == {
        "grpc_server_started_total": 1.0,
        "grpc_server_msg_received_total": 1.0,
        "grpc_server_handling_seconds_count": 1.0,
        code: 1.0,
        **sent,
    }


def test_server_stream_counts_each_message_sent(probe) -> None:
    channel, metrics = probe
    delta = _Delta(metrics, "ServerStream", "server_stream")
    assert list(channel.unary_stream(f"/{SERVICE}/ServerStream")(b"ok", timeout=10)) == [b"x"] * 3
    changes = delta.changes()
    assert changes["grpc_server_msg_sent_total"] == 3.0
    assert changes["OK"] == 1.0 and changes["grpc_server_started_total"] == 1.0


@pytest.mark.parametrize(
    ("payload", "code"), [(b"raise", "UNKNOWN"), (b"abort", "RESOURCE_EXHAUSTED")]
)
def test_stream_that_fails_mid_stream_is_handled_with_its_final_code(probe, payload, code) -> None:
    channel, metrics = probe
    delta = _Delta(metrics, "ServerStream", "server_stream")
    received = []
    with pytest.raises(grpc.RpcError) as err:
        received.extend(channel.unary_stream(f"/{SERVICE}/ServerStream")(payload, timeout=10))
    assert err.value.code().name == code
    changes = delta.wait_for(code)
    assert changes[code] == 1.0
    assert changes["grpc_server_msg_sent_total"] == 2.0
    assert "OK" not in changes and changes["grpc_server_handling_seconds_count"] == 1.0


def test_stream_the_client_cancels_is_handled_as_cancelled(probe) -> None:
    channel, metrics = probe
    delta = _Delta(metrics, "ServerStream", "server_stream")
    call = channel.unary_stream(f"/{SERVICE}/ServerStream")(b"forever", timeout=30)
    next(call), next(call)
    call.cancel()
    changes = delta.wait_for("CANCELLED")
    assert changes["CANCELLED"] == 1.0
    assert "OK" not in changes and "UNKNOWN" not in changes


def test_deadline_that_expires_mid_stream_is_handled_as_deadline_exceeded(probe) -> None:
    channel, metrics = probe
    delta = _Delta(metrics, "ServerStream", "server_stream")
    call = channel.unary_stream(f"/{SERVICE}/ServerStream")(b"forever", timeout=3)
    next(call)  # the handler runs: the deadline passes mid-stream, not while it queues
    with pytest.raises(grpc.RpcError) as err:
        list(call)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert delta.wait_for("DEADLINE_EXCEEDED")["DEADLINE_EXCEEDED"] == 1.0


def test_client_stream_counts_each_message_received(probe) -> None:
    channel, metrics = probe
    delta = _Delta(metrics, "ClientStream", "client_stream")
    reply = channel.stream_unary(f"/{SERVICE}/ClientStream")(iter([b"a"] * 5), timeout=10)
    assert reply == b"5"
    changes = delta.wait_for("OK")  # counted as the call ends, maybe after the reply
    assert changes["grpc_server_msg_received_total"] == 5.0
    assert changes["grpc_server_msg_sent_total"] == 1.0 and changes["OK"] == 1.0


def test_bidi_stream_counts_messages_both_ways(probe) -> None:
    channel, metrics = probe
    delta = _Delta(metrics, "BidiStream", "bidi_stream")
    replies = list(channel.stream_stream(f"/{SERVICE}/BidiStream")(iter([b"a"] * 4), timeout=10))
    assert replies == [b"a"] * 4
    changes = delta.wait_for("OK")
    assert changes["grpc_server_msg_received_total"] == 4.0
    assert changes["grpc_server_msg_sent_total"] == 4.0 and changes["OK"] == 1.0


class _Arrivals(grpc.ServerInterceptor):
    """Sets `second` as the second call arrives; it runs after the metrics interceptor,
    which so has taken that call's arrival time already."""

    def __init__(self) -> None:
        self.second = threading.Event()
        self._count = 0

    def intercept_service(self, continuation, handler_call_details):
        self._count += 1
        if self._count == 2:
            self.second.set()
        return continuation(handler_call_details)


def test_handling_time_includes_waiting_for_a_free_worker() -> None:
    metrics, arrivals = ServerMetrics(), _Arrivals()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=1),
        interceptors=[MetricsInterceptor(metrics), arrivals],
    )
    entered, release = threading.Event(), threading.Event()

    def blocking(request: bytes, context: grpc.ServicerContext) -> bytes:
        if request == b"block":
            entered.set()
            release.wait(10)
        return request

    handler = grpc.unary_unary_rpc_method_handler(blocking)
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(SERVICE, {"Unary": handler})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary(f"/{SERVICE}/Unary")
            blocked = call.future(b"block", timeout=10)
            assert entered.wait(10)
            queued = call.future(b"queued", timeout=10)
            assert arrivals.second.wait(10)  # the server has it: from now on it waits
            time.sleep(0.5)
            release.set()
            assert blocked.result() == b"block" and queued.result() == b"queued"
        seconds = _value(metrics, "grpc_server_handling_seconds_sum", "Unary", "unary")
        assert seconds >= 2 * 0.5  # both waited: one in its handler, one for the only worker
    finally:
        server.stop(0)


class _Details(NamedTuple):
    method: str
    invocation_metadata: tuple


class _EndedCall:
    """The little of a ServicerContext a non-blocking handler's metrics read, for a call
    its client ended before the handler ran: gRPC then adds no callback. The ordering
    cannot be forced on a real server, so this stands in for its context."""

    def add_callback(self, callback) -> bool:
        return False

    def is_active(self) -> bool:
        return False

    def code(self) -> None:
        return None

    def time_remaining(self) -> None:
        return None


def test_a_non_blocking_call_ended_before_its_handler_ran_is_counted_once() -> None:
    def watch(request: bytes, context: grpc.ServicerContext, send) -> None:
        """Returns at once and sends nothing, as a Watch of an ended call does."""

    non_blocking(watch)
    metrics = ServerMetrics()
    details = _Details(f"/{SERVICE}/Watch", ())
    handler = MetricsInterceptor(metrics).intercept_service(
        lambda _: grpc.unary_stream_rpc_method_handler(watch), details
    )
    delta = _Delta(metrics, "Watch", "server_stream")
    handler.unary_stream(b"", _EndedCall(), lambda response: None)
    assert delta.changes() == {
        "grpc_server_started_total": 1,
        "grpc_server_msg_received_total": 1,
        "grpc_server_handling_seconds_count": 1,
        "CANCELLED": 1,
    }
