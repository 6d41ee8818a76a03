"""Starting and stopping a server: ports, the ready line, draining on SIGTERM."""

from __future__ import annotations

import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pergrad.client import GradientClient, GradientResult
from pergrad.server.config import Config
from pergrad.server.main import start
from tests.helpers import batch_for, loopback_config

READY = re.compile(r"pergrad ready on (\S+:\d+) .* metrics on http://\S+:(\d+)/metrics")


def _config(**overrides: object) -> Config:
    return loopback_config("mnist_mlp", **overrides)


def test_ready_line_names_the_grpc_and_metrics_ports(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pergrad.server.main"):
        running = start(_config())
    try:
        match = READY.search(caplog.text)
        assert match, caplog.text
        assert match.group(1) == f"127.0.0.1:{running.port}"
        assert int(match.group(2)) == running.metrics_port != 0
    finally:
        running.stop(0)


def test_metrics_port_in_use_refuses_to_start() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot bind the metrics endpoint 127.0.0.1:{port}"):
            start(_config(metrics_port=port))


def test_stop_closes_the_metrics_endpoint() -> None:
    running = start(_config())
    url = f"http://127.0.0.1:{running.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
    running.stop(0)
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=10)


class _Serve:
    """`pergrad serve` in a process of its own, with its log kept."""

    def __init__(self, *flags: str) -> None:
        command = [sys.executable, "-m", "pergrad.cli", "serve", *flags]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        match = None
        for line in self.process.stderr:
            self.log.append(line)
            if match := READY.search(line):
                break
        assert match, "server never logged its ready line:\n" + "".join(self.log)
        self.target, self.metrics_port = match.group(1), int(match.group(2))
        threading.Thread(target=self._keep_log, daemon=True).start()

    def _keep_log(self) -> None:
        self.log.extend(self.process.stderr)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


@pytest.fixture()
def serving(tmp_path: Path) -> Iterator[_Serve]:
    flags = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--grace", "30"]
    served = _Serve(*flags, "--model", "mnist_mlp", "--jit-compile", "off")
    yield served
    served.close()


def _watch_health(target: str) -> tuple[grpc.Channel, Iterator[health_pb2.HealthCheckResponse]]:
    channel = grpc.insecure_channel(target)
    updates = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    return channel, updates


def test_sigterm_drains_a_request_in_flight_then_exits_zero(serving: _Serve) -> None:
    """The request spans the signal: one batch before it, three after NOT_SERVING."""
    batches = [batch_for((784,), 10, size, seed=size) for size in (64, 32, 16, 8)]
    first_result, resume = threading.Event(), threading.Event()
    results: list[GradientResult] = []

    def feed() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        yield batches[0]
        resume.wait(60)
        yield from batches[1:]

    def request() -> None:
        with GradientClient(serving.target, timeout=60) as client:
            for result in client.stream("mnist_mlp", feed(), timeout=120):
                results.append(result)
                first_result.set()

    channel, health = _watch_health(serving.target)
    with channel:
        assert next(health).status == health_pb2.HealthCheckResponse.SERVING
        caller = threading.Thread(target=request)
        caller.start()
        assert first_result.wait(60), "".join(serving.log)
        serving.process.send_signal(signal.SIGTERM)
        assert next(health).status == health_pb2.HealthCheckResponse.NOT_SERVING
        health.cancel()
    resume.set()
    caller.join(timeout=120)
    assert [r.batch_size for r in results] == [64, 32, 16, 8]
    assert all(np.isfinite(r.losses).all() for r in results)
    assert serving.process.wait(timeout=60) == 0, "".join(serving.log)


def test_sigterm_while_starting_drains_and_exits_zero() -> None:
    """A stop that arrives before the server is ready (a pod deleted as it starts, or just
    as it turns ready) is a drain and a clean exit, never death by the signal."""
    command = [
        sys.executable, "-m", "pergrad.cli", "serve", "--host", "127.0.0.1", "--port", "0",
        "--metrics-port", "0", "--model", "mnist_mlp", "--jit-compile", "off",
    ]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    log = []
    for line in process.stderr:  # it names its devices before it loads the models
        log.append(line)
        if "devices:" in line:
            process.send_signal(signal.SIGTERM)
            break
    log.extend(process.stderr)
    assert process.wait(timeout=120) == 0, "".join(log)
    assert "stopped" in log[-1], "".join(log)


HANGING_STOP = """
import sys, threading
from pergrad.server import main
main.STOP_SLACK_S = 1.0
main.RunningServer.stop = lambda self, grace_s: threading.Event().wait()
sys.exit(main.serve(sys.argv[1:]))
"""


def test_a_stop_that_hangs_prints_every_threads_stack_and_exits_1() -> None:
    flags = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--grace", "0"]
    command = [sys.executable, "-c", HANGING_STOP, *flags, "--model", "mnist_mlp"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:
            if READY.search(line):
                break
        process.send_signal(signal.SIGTERM)
        log = process.stderr.read()
        assert process.wait(timeout=60) == 1
    finally:
        process.kill()
    assert "Timeout (0:00:01)!" in log and "Thread 0x" in log and "in serve" in log
