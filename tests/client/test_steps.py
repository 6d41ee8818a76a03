"""A step whose server goes away mid-call is sent again (client/_steps.py).

The step's pass is held at its server's gate while a second server, of equal weights,
listens on the same port (gRPC's servers share a port, SO_REUSEPORT); the first then
stops at once, its call ending UNAVAILABLE, and only the second is left to answer a step
sent again, whatever the machine's load."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest

from pergrad.client import GradientClient, StepResult
from pergrad.client._call import Call
from pergrad.client._methods import Methods
from pergrad.client._steps import on_one, step_call, step_request
from pergrad.server.main import RunningServer
from pergrad.server.recent_steps import MAX_STEP_ID_CHARS
from tests.pauses import gated_server

MODEL = "gated"


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


@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "unpinned"])
def test_a_step_is_sent_again_to_the_server_that_took_its_place(servers, pinned) -> None:
    done = _step_when_its_server_goes(servers, pinned=pinned)
    with GradientClient(f"127.0.0.1:{servers[1].port}") as client:
        info = client.model_info(MODEL)
    assert done.server == "second"
    assert (info.model_version, info.weights_id) == (done.model_version, done.weights_id)
    assert done.model_version == 2


def test_each_step_has_an_id_of_its_own(servers) -> None:
    """Two steps of the same batch are two steps: each applied (the ids are the client's,
    fresh for each)."""
    _, server = gated_server()
    servers.append(server)
    x, y = np.random.default_rng(0).standard_normal((8, 4)), np.arange(8) % 3
    with GradientClient(f"127.0.0.1:{server.port}") as client:
        versions = [client.step(MODEL, x, y, learning_rate=0.1, max_norm=1.0) for _ in range(2)]
    assert [v.model_version for v in versions] == [2, 3]


def test_every_step_request_has_a_fresh_id_within_the_servers_bound() -> None:
    call = Call.of(MODEL, reduction="clipped_sum", max_norm=1.0)
    ids = [step_request(call, 0.1, 0).step_id for _ in range(100)]
    assert len(set(ids)) == len(ids)
    assert all(0 < len(step_id) <= MAX_STEP_ID_CHARS for step_id in ids)


class _ReplyLost(grpc.RpcError):
    """What a call whose connection dropped after the server answered ends with."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "the reply was lost"


def test_a_step_whose_reply_was_lost_is_applied_once(servers) -> None:
    """The first attempt reaches the server and is applied; its reply never reaches the
    client. The step sent again carries the same id, and the server answers it as it did
    the first time."""
    _, server = gated_server()
    servers.append(server)
    target = f"127.0.0.1:{server.port}"
    x, y = np.random.default_rng(0).standard_normal((8, 4)), np.arange(8) % 3
    with GradientClient(target) as client, grpc.insecure_channel(target) as channel:
        info = client.model_info(MODEL)
        methods, first = Methods(channel), []

        def reply_lost_once(request: Any, **kwargs: Any) -> Any:
            reply = methods.step(request, **kwargs)
            if not first:
                first.append(reply)
                raise _ReplyLost()
            return reply

        call = Call.of(MODEL, reduction="clipped_sum", max_norm=1.0, timeout=60)
        batch, step = step_call(call), step_request(call, 0.1, 0)
        done = on_one(reply_lost_once, info, batch, x, y, step, retries=2)
        after = client.model_info(MODEL)
    assert (done.model_version, done.weights_id) == (2, first[0].weights_id)
    assert (after.model_version, after.weights_id) == (2, done.weights_id)
