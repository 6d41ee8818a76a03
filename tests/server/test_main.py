"""Starting and stopping a server in-process: ports, the ready line, the metrics endpoint."""

from __future__ import annotations

import logging
import socket
import urllib.error
import urllib.request

import pytest
import tensorflow as tf

from pergrad.client import GradientClient
from pergrad.server.config import Config
from pergrad.server.main import start
from tests.helpers import READY, loopback_config


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


def test_a_started_server_reports_its_coalescing_bound_resolved() -> None:
    """ModelInfo's limits say what the server does: auto resolved for this machine."""
    running = start(loopback_config("mnist_mlp", max_coalesced_batch=None))
    try:
        with GradientClient(f"127.0.0.1:{running.port}") as client:
            limits = client.model_info("mnist_mlp").limits
    finally:
        running.stop(0)
    gpu = bool(tf.config.list_physical_devices("GPU"))
    assert limits.max_coalesced_batch == Config().coalescing_bound(gpu=gpu)
