"""A step sent again with its id is answered as it was first, not applied twice
(server/recent_steps.py, StepRequest.step_id)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from pergrad.client import GradientClient
from pergrad.server.main import RunningServer
from pergrad.server.recent_steps import MAX_STEP_ID_CHARS, RECENT_STEPS
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.codec import encode_tensor
from tests.helpers import batch_for
from tests.pauses import gated_server

PROTO = Path(__file__).resolve().parents[2] / "protos/pergrad/v1/gradient_service.proto"
MODEL = "mnist_mlp"


def _step(step_id: str) -> bytes:
    x, y = batch_for((784,), 10, 8)
    batch = pb.GradientsRequest(
        inputs=encode_tensor(x), labels=encode_tensor(y), reduction=pb.REDUCTION_MOMENTS
    )
    request = pb.StepRequest(model=MODEL, learning_rate=0.1, batch=batch, step_id=step_id)
    return request.SerializeToString()


def _send(server: RunningServer, *steps: bytes) -> list[pb.StepResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        apply_step = channel.unary_unary(
            "/pergrad.v1.GradientService/ApplyStep",
            response_deserializer=pb.StepResponse.FromString,
        )
        return [apply_step(step, timeout=60) for step in steps]


def _version(server: RunningServer) -> int:
    with GradientClient(f"127.0.0.1:{server.port}") as client:
        return client.model_info(MODEL).model_version


def test_a_step_sent_again_is_answered_as_first_and_applied_once(fresh_server) -> None:
    first, again = _send(fresh_server, _step("a"), _step("a"))
    assert again.SerializeToString() == first.SerializeToString()
    assert first.model_version == 2 == _version(fresh_server)


def test_a_step_of_another_id_is_applied(fresh_server) -> None:
    first, other = _send(fresh_server, _step("a"), _step("b"))
    assert (first.model_version, other.model_version) == (2, 3)


def test_a_step_without_an_id_is_applied_each_time(fresh_server) -> None:
    first, again = _send(fresh_server, _step(""), _step(""))
    assert (first.model_version, again.model_version) == (2, 3)


def test_only_the_last_recent_steps_are_remembered(fresh_server) -> None:
    """The oldest id falls out once RECENT_STEPS newer steps are applied: sent again, its
    step is applied as a new one."""
    _send(fresh_server, *(_step(f"s{i}") for i in range(RECENT_STEPS + 1)))
    kept, forgotten = _send(fresh_server, _step("s1"), _step("s0"))
    assert kept.model_version == 3
    assert forgotten.model_version == RECENT_STEPS + 3


def test_an_id_over_the_limit_is_invalid_argument(fresh_server) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        _send(fresh_server, _step("x" * (MAX_STEP_ID_CHARS + 1)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "step_id" in refused.value.details()
    assert _version(fresh_server) == 1


def test_the_proto_states_the_bounds() -> None:
    text = " ".join(PROTO.read_text().split())
    assert f"at most {MAX_STEP_ID_CHARS} characters" in text
    assert f"among the last {RECENT_STEPS} with an id this server applied" in text


def test_a_step_sent_twice_at_once_is_applied_once() -> None:
    """The second copy arrives while the first is in its pass (held at a gate): it waits
    for the model's turn, then finds the first's id."""
    gate, server = gated_server()
    batch = pb.GradientsRequest(
        inputs=encode_tensor(np.ones((4, 4), np.float32)),
        labels=encode_tensor(np.arange(4, dtype=np.int32) % 3),
        reduction=pb.REDUCTION_MOMENTS,
    )
    step = pb.StepRequest(model="gated", learning_rate=0.1, batch=batch, step_id="twice")
    try:
        with ThreadPoolExecutor(2) as pool, gate.closed():
            first = pool.submit(_send, server, step.SerializeToString())
            assert gate.entered.acquire(timeout=60), "the first step's pass never began"
            second = pool.submit(_send, server, step.SerializeToString())
            time.sleep(0.5)  # not needed for the outcome: gives the copy time to queue
        responses = [first.result(timeout=60)[0], second.result(timeout=60)[0]]
    finally:
        server.stop(0)
    assert responses[0].SerializeToString() == responses[1].SerializeToString()
    assert responses[0].model_version == 2
