"""Clients that go away: cancelled, past their deadline, or killed mid-stream. The server
stops the work, frees the call's place and memory, and keeps serving."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from pergrad.client import GradientClient, PergradError
from pergrad.server.main import RunningServer, start
from tests.helpers import batch_for, loopback_config
from tests.prometheus import sample_value, scrape

BIG = 200  # wide_mlp: 200 x 7.4 MB of per-example gradients, seconds to compute and send


@pytest.fixture(scope="module")
def wide_server() -> Iterator[RunningServer]:
    """Admits BIG examples at once: a call that ended without giving its place back would
    leave every later batch of BIG refused."""
    running = start(loopback_config("wide_mlp", max_inflight_examples=BIG))
    yield running
    running.stop(0)


def _idle_soon(server: RunningServer, timeout_s: float = 20) -> bool:
    """True once no request is in flight, polled from the real /metrics."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sample_value(scrape(server.metrics_port), "pergrad_requests_in_flight") == 0:
            return True
        time.sleep(0.1)
    return False


def _still_serving(server: RunningServer) -> None:
    """A batch that needs every admitted place runs: the ended call gave its places back."""
    with GradientClient(f"127.0.0.1:{server.port}") as client:
        x, y = batch_for((3072,), 10, BIG)
        result = client.per_example_gradients("wide_mlp", x, y, reduction="norms")
        assert result.batch_size == BIG


def test_cancelled_stream_stops_and_frees_its_place(wide_server) -> None:
    x, y = batch_for((3072,), 10, BIG)
    with GradientClient(f"127.0.0.1:{wide_server.port}", timeout=120) as client:
        results = client.stream("wide_mlp", [(x[:2], y[:2]), (x, y), (x, y)])
        assert next(results).batch_size == 2
        results.close()  # cancels the call while the big batches are computed and sent
    assert _idle_soon(wide_server)
    _still_serving(wide_server)


def test_deadline_stops_the_work(wide_server) -> None:
    x, y = batch_for((3072,), 10, BIG)
    with GradientClient(f"127.0.0.1:{wide_server.port}") as client:
        client.model_info("wide_mlp")
        with pytest.raises(PergradError) as err:
            client.per_example_gradients("wide_mlp", x, y, timeout=0.3)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _idle_soon(wide_server)
    _still_serving(wide_server)


def test_client_killed_mid_stream_leaves_the_server_serving(wide_server) -> None:
    code = (
        "import numpy as np, sys; from pergrad.client import GradientClient\n"
        "x = np.zeros((200, 3072), np.float32); y = np.zeros(200, np.int32)\n"
        f"c = GradientClient('127.0.0.1:{wide_server.port}')\n"
        "print('calling', flush=True); c.per_example_gradients('wide_mlp', x, y)\n"
    )
    client = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert client.stdout.readline().strip() == "calling"
    time.sleep(1.0)
    client.send_signal(signal.SIGKILL)
    client.wait(timeout=30)
    assert _idle_soon(wide_server)
    _still_serving(wide_server)
