"""A gradients request's batch refused before it is parsed (`oversized_batch`) with the
refusal its parsed form gets (`tests/wire/test_declared.py` holds the reading of its
bytes to protobuf's parsing)."""

from __future__ import annotations

from pergrad.server.gradients import oversized_batch
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2

MAX_BATCH = 100


def _request(*, inputs: int, labels: int) -> pb.GradientsRequest:
    return pb.GradientsRequest(
        model="m",
        inputs=tensor_pb2.Tensor(shape=[inputs, 3]),
        labels=tensor_pb2.Tensor(shape=[labels]),
    )


def test_a_batch_within_max_batch_is_left_to_the_parser() -> None:
    assert oversized_batch(_request(inputs=100, labels=100).SerializeToString(), MAX_BATCH) is None


def test_a_batch_over_max_batch_is_refused_naming_the_tensor_and_the_limit() -> None:
    refusal = oversized_batch(_request(inputs=5, labels=101).SerializeToString(), MAX_BATCH)
    assert refusal is not None and refusal.code == "RESOURCE_EXHAUSTED"
    assert str(refusal) == (
        "labels: batch of 101 exceeds --max-batch 100 (ModelInfo.limits.max_batch); split it"
    )


def test_a_steps_batch_is_refused_in_its_field() -> None:
    step = pb.StepRequest(model="m", batch=_request(inputs=5000, labels=5000))
    refusal = oversized_batch(
        step.SerializeToString(), MAX_BATCH, in_field=pb.StepRequest.BATCH_FIELD_NUMBER
    )
    assert str(refusal).startswith("inputs: batch of 5000 exceeds")


def test_bytes_it_cannot_read_are_left_to_the_parser() -> None:
    """A group in front (which upb skips) hides the rest from a reading without parsing."""
    data = bytes([0x7B, 0x7C]) + _request(inputs=5000, labels=5000).SerializeToString()
    assert pb.GradientsRequest.FromString(data).inputs.shape[0] == 5000
    assert oversized_batch(data, MAX_BATCH) is None
