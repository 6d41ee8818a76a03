"""Fixtures for deploy/ checks: a server that has served traffic, its /metrics text."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from pergrad.client import GradientClient, PergradError
from pergrad.server.main import RunningServer
from tests.helpers import batch_for
from tests.prometheus import scrape


def serve_some_traffic(target: str, calls: int = 3) -> None:
    """Unary and streamed gradients and one refused call, so every histogram has samples."""
    x, y = batch_for((784,), 10, 4)
    with GradientClient(target, timeout=60) as client:
        for _ in range(calls):
            client.per_example_gradients("mnist_mlp", x, y)
        list(client.stream("mnist_mlp", [(x, y), (x[:2], y[:2])]))
        client.list_models()
        with contextlib.suppress(PergradError):
            client.per_example_gradients("mnist_mlp", x, np.full(4, 99, np.int32))


@pytest.fixture(scope="session")
def exposition(server: RunningServer) -> str:
    """/metrics of the shared server after it served some of every kind of call."""
    serve_some_traffic(f"127.0.0.1:{server.port}")
    return scrape(server.metrics_port)
