"""Starting and stopping a server in-process: ports, the ready line, the metrics endpoint."""

from __future__ import annotations

import logging
import socket
import urllib.error
import urllib.request

import pytest
import tensorflow as tf

from pergrad.client import GradientClient
from pergrad.server.config import AUTO_COALESCED_BATCH, Config
from pergrad.server.devices import with_coalescing_resolved
from pergrad.server.main import start
from pergrad.server.models.registry import ModelRegistry
from pergrad.server.service import GradientServicer
from tests.helpers import READY, batch_for, loopback_config
from tests.prometheus import sample_value, scrape


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


def test_a_server_on_auto_reports_and_does_what_this_machine_resolves() -> None:
    """ModelInfo's limits say the bound auto resolved to here, and a small request shares
    a pass exactly where that bound is above 0."""
    running = start(loopback_config("mnist_mlp", max_coalesced_batch=None))
    try:
        with GradientClient(f"127.0.0.1:{running.port}") as client:
            limits = client.model_info("mnist_mlp").limits
            x, y = batch_for((784,), 10, 4)
            assert client.per_example_gradients(
                "mnist_mlp", x, y, reduction="norms"
            ).norms.shape == (4,)
        exposition = scrape(running.metrics_port)
    finally:
        running.stop(0)
    bound = Config().coalescing_bound(gpu=bool(tf.config.list_physical_devices("GPU")))
    assert limits.max_coalesced_batch == bound
    passes = sample_value(exposition, "pergrad_coalesced_pass_requests_count", model="mnist_mlp")
    assert (passes or 0) == (1 if bound else 0)


@pytest.mark.parametrize("gpus", [[], ["/physical_device:GPU:0"]])
def test_auto_coalescing_is_resolved_by_the_devices_tensorflow_sees(
    gpus: list[str], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: gpus)
    with caplog.at_level(logging.INFO, logger="pergrad.server.devices"):
        resolved = with_coalescing_resolved(Config())
    assert resolved.max_coalesced_batch == (AUTO_COALESCED_BATCH if gpus else 0)
    assert f"--max-coalesced-batch {resolved.max_coalesced_batch} (auto, " in caplog.text


def test_a_server_cannot_be_built_with_coalescing_unresolved() -> None:
    with pytest.raises(ValueError, match="auto must be made a number first"):
        GradientServicer(ModelRegistry([]), Config())
