"""A step whose server goes away mid-call: sent again only when pinned (client/_steps.py).

The step's pass is held at its server's gate while a second server, of equal weights,
listens on the same port (gRPC's servers share a port, SO_REUSEPORT); the first then
stops at once, its call ending UNAVAILABLE, and only the second is left to answer a step
sent again, whatever the machine's load."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from pergrad.client import GradientClient, PergradError, StepResult
from pergrad.server.main import RunningServer
from tests.pauses import gated_server

MODEL = "gated"


@pytest.fixture()
def servers() -> Iterator[list[RunningServer]]:
    """Servers the test starts, stopped after it."""
    running: list[RunningServer] = []
    yield running
    for server in running:
        server.stop(0)


def _step_when_its_server_goes(servers: list[RunningServer], *, pinned: bool) -> StepResult:
    """A step (pinned to the weights it starts from, or not) whose pass is held on the
    first server until a second one listens on its port and the first stops."""
    gate, first = gated_server(replica_name="first")
    servers.append(first)
    x, y = np.random.default_rng(0).standard_normal((8, 4)), np.arange(8) % 3
    with GradientClient(f"127.0.0.1:{first.port}", timeout=60, retries=2) as client:
        info = client.model_info(MODEL)
        pins = {"model_version": info.model_version, "weights_id": info.weights_id}
        pins = pins if pinned else {}
        with ThreadPoolExecutor(1) as pool, gate.closed():
            step = pool.submit(client.step, MODEL, x, y, learning_rate=0.1, max_norm=1.0, **pins)
            assert gate.entered.acquire(timeout=60), "the step's pass never began"
            servers.append(gated_server(replica_name="second", port=first.port)[1])
            first.stop(0)
        return step.result(timeout=120)


def test_a_pinned_step_is_sent_again_to_the_server_that_took_its_place(servers) -> None:
    done = _step_when_its_server_goes(servers, pinned=True)
    second = servers[1]
    with GradientClient(f"127.0.0.1:{second.port}") as client:
        info = client.model_info(MODEL)
    assert done.server == "second"
    assert (info.model_version, info.weights_id) == (done.model_version, done.weights_id)
    assert done.model_version == 2


def test_an_unpinned_step_is_not_sent_again(servers) -> None:
    with pytest.raises(PergradError) as gone:
        _step_when_its_server_goes(servers, pinned=False)
    with GradientClient(f"127.0.0.1:{servers[1].port}") as client:
        info = client.model_info(MODEL)
    assert gone.value.code == grpc.StatusCode.UNAVAILABLE
    assert info.model_version == 1
