"""A gradients request's batch refused from its bytes, unparsed (`oversized_batch`),
against what protobuf parses from the same bytes: the refusal must fall exactly where
the parsed request's own check (its tensors' first dimensions) falls."""

from __future__ import annotations

import pytest

from pergrad.server.gradients import oversized_batch
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2

MAX_BATCH = 100
INPUTS = pb.GradientsRequest.INPUTS_FIELD_NUMBER
NAMED = pb.GradientsRequest.NAMED_INPUTS_FIELD_NUMBER


def _tensor(*shape: int, content: bytes = b"") -> tensor_pb2.Tensor:
    return tensor_pb2.Tensor(dtype=tensor_pb2.DATA_TYPE_FLOAT32, shape=shape, content=content)


def _request(**fields: object) -> bytes:
    return pb.GradientsRequest(model="m", **fields).SerializeToString()


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def _field(number: int, message: bytes) -> bytes:
    """One length-delimited field, as protobuf writes it."""
    return _varint(number << 3 | 2) + _varint(len(message)) + message


def _entry(key: str, tensor: tensor_pb2.Tensor) -> bytes:
    return _field(NAMED, _field(1, key.encode()) + _field(2, tensor.SerializeToString()))


def _parsed_over(data: bytes) -> list[int]:
    """The first dimensions over MAX_BATCH of the request protobuf parses."""
    request = pb.GradientsRequest.FromString(data)
    tensors = [request.inputs, request.labels, *request.named_inputs.values()]
    return [t.shape[0] for t in tensors if t.shape and t.shape[0] > MAX_BATCH]


CASES = {
    "inputs over": _request(inputs=_tensor(5000, 784), labels=_tensor(5000)),
    "labels over": _request(inputs=_tensor(5, 784), labels=_tensor(101)),
    "within": _request(inputs=_tensor(100, 784, content=b"\0" * 40), labels=_tensor(100)),
    "a named input over": _request(named_inputs={"a": _tensor(3), "b": _tensor(200)}),
    "inputs in two parts, the shape in the second": (
        _field(INPUTS, _tensor(content=b"ab").SerializeToString())
        + _field(INPUTS, _tensor(5000).SerializeToString())
    ),
    "inputs in two parts, both shaped": (
        _field(INPUTS, _tensor(2).SerializeToString())
        + _field(INPUTS, _tensor(5000).SerializeToString())
    ),
    "a map key sent twice, the later entry within": _entry("a", _tensor(5000))
    + _entry("a", _tensor(2)),
    "a map key sent twice, the later entry over": _entry("a", _tensor(2))
    + _entry("a", _tensor(5000)),
    "a negative batch": _request(inputs=_tensor(-5000, 784)),
    "a scalar": _request(inputs=_tensor(), labels=_tensor()),
}


@pytest.mark.parametrize("data", CASES.values(), ids=CASES.keys())
def test_a_batch_is_refused_from_its_bytes_exactly_where_parsing_refuses_it(data: bytes) -> None:
    refusal = oversized_batch(data, MAX_BATCH)
    over = _parsed_over(data)
    assert (refusal is not None) == bool(over)
    if refusal is not None:
        assert f"batch of {over[0]} exceeds --max-batch {MAX_BATCH}" in str(refusal)


def test_the_refusal_names_the_tensor() -> None:
    assert str(oversized_batch(CASES["labels over"], MAX_BATCH)).startswith("labels: ")
    named = str(oversized_batch(CASES["a named input over"], MAX_BATCH))
    assert named.startswith("inputs['b']: ")


def test_in_a_stream_the_refusal_names_its_request() -> None:
    data = _request(inputs=_tensor(5000), labels=_tensor(5000), request_id=7)
    assert str(oversized_batch(data, MAX_BATCH, stream=True)).startswith("request 7: inputs: ")


def test_a_steps_batch_is_read_inside_its_field() -> None:
    batch = pb.GradientsRequest(inputs=_tensor(5000), labels=_tensor(5000))
    data = pb.StepRequest(model="m", batch=batch).SerializeToString()
    assert oversized_batch(data, MAX_BATCH) is None
    refusal = oversized_batch(data, MAX_BATCH, in_field=pb.StepRequest.BATCH_FIELD_NUMBER)
    assert refusal is not None and refusal.code == "RESOURCE_EXHAUSTED"


def test_bytes_it_cannot_read_are_left_to_the_parser() -> None:
    """A group in front (which upb skips) hides the rest from a reading without parsing."""
    data = bytes([0x7B, 0x7C]) + CASES["inputs over"]
    assert _parsed_over(data)
    assert oversized_batch(data, MAX_BATCH) is None
