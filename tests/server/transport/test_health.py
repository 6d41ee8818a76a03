"""The grpc.health.v1 service: Watch streams hold no worker and end when serving stops."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pergrad.server.main import start
from pergrad.server.transport.health import HealthService
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import gradient_service_pb2_grpc as pb_grpc
from tests.helpers import loopback_config

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _server(model_dir: Path, **settings: object):
    return start(loopback_config("mnist_mlp", model_dir=model_dir, **settings))


def test_stopping_ends_open_watch_streams_instead_of_waiting_out_the_grace(
    model_dir: Path,
) -> None:
    running = _server(model_dir)
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        updates = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert next(updates).status == SERVING
        started = time.monotonic()
        stopping = threading.Thread(target=running.stop, args=(60,))
        stopping.start()
        assert [u.status for u in updates] == [NOT_SERVING]  # then the stream ends, OK
        stopping.join(timeout=60)
        assert updates.code() == grpc.StatusCode.OK
    assert not stopping.is_alive()
    assert time.monotonic() - started < 30, "the drain waited for the Watch stream"


def test_idle_watch_streams_leave_the_workers_free(model_dir: Path) -> None:
    running = _server(model_dir, workers=2)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(8)]
            assert all(next(w).status == SERVING for w in watches)
            reply = pb_grpc.GradientServiceStub(channel).ListModels(
                pb.ListModelsRequest(), timeout=10
            )
            assert list(reply.models) == ["mnist_mlp"]
            for watch in watches:
                watch.cancel()
    finally:
        running.stop(0)


def test_check_of_an_unknown_service_is_not_found(server) -> None:
    with (
        grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel,
        pytest.raises(grpc.RpcError) as caught,
    ):
        health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10
        )
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_watch_of_an_unknown_service_says_so(server) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        updates = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="no.such.Service")
        )
        assert next(updates).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        updates.cancel()


class _Call:
    """The little of a ServicerContext that Watch uses: callbacks run when the call ends."""

    def __init__(self) -> None:
        self.callbacks: list = []

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True


def test_no_reply_is_sent_while_the_servicer_lock_is_held() -> None:
    """gRPC's thread ending a cancelled Watch holds the call's lock and takes the servicer's
    (`_forget`); a send made under the servicer's lock needs the call's: a deadlock that left
    the server answering nothing. Every send here checks the lock is free."""
    health = HealthService()
    sent: list = []

    def send(reply) -> None:
        assert not health._lock.locked(), "a Watch reply sent under the servicer's lock"
        sent.append(reply if reply is None else reply.status)

    call = _Call()
    health.set("", SERVING)
    health.Watch(health_pb2.HealthCheckRequest(), call, send)
    health.set("", NOT_SERVING)
    health.stop_serving()
    health.Watch(health_pb2.HealthCheckRequest(), _Call(), send)  # after the stop
    for callback in call.callbacks:
        callback()
    assert sent == [SERVING, NOT_SERVING, NOT_SERVING, None, NOT_SERVING, None]


def test_watchers_cancelled_as_they_open_leave_the_server_answering(model_dir: Path) -> None:
    """Many Watch streams cancelled at once while the status changes: the server still
    answers, and stops."""
    running = _server(model_dir)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for round_ in range(20):
                watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(8)]
                running.health.set("", NOT_SERVING if round_ % 2 else SERVING)
                for watch in watches:
                    watch.cancel()
            reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status in (SERVING, NOT_SERVING)
    finally:
        stopping = threading.Thread(target=running.stop, args=(0,), daemon=True)
        stopping.start()
        stopping.join(timeout=30)
    assert not stopping.is_alive(), "the server could not stop"
