"""What a request's bytes declare (`wire.declared`) against what protobuf parses from the
same bytes, the source of truth: the fields a message holds, the model it names."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2
from pergrad.wire.declared import declared_model, first_nested_string, holds_over
from pergrad.wire.fields import MAX_SCANNED, encode_varint

INPUTS = pb.GradientsRequest.INPUTS_FIELD_NUMBER
NAMED = pb.GradientsRequest.NAMED_INPUTS_FIELD_NUMBER
REQUEST_ID = pb.GradientsRequest.REQUEST_ID_FIELD_NUMBER
SHAPE = tensor_pb2.Tensor.SHAPE_FIELD_NUMBER


def _key(number: int, wire_type: int) -> bytes:
    return encode_varint(number << 3 | wire_type)


def _delimited(number: int, body: bytes) -> bytes:
    return _key(number, 2) + encode_varint(len(body)) + body


numbers = st.sampled_from([0, 1, 2, 100, 101, 5000, -1, -5000, 2**63 - 1, 2**64 + 7])
unknown = st.one_of(
    st.builds(
        lambda n, v: _key(n, 0) + encode_varint(v), st.sampled_from([1, 2, 3, 16, 99]), numbers
    ),
    st.builds(lambda n: _key(n, 1) + bytes(8), st.sampled_from([2, 3, 5, 99])),
    st.builds(lambda n: _key(n, 5) + bytes(4), st.sampled_from([2, 3, 99])),
    st.builds(lambda n, b: _delimited(n, b), st.sampled_from([5, 7, 99]), st.binary(max_size=3)),
)
shape_parts = st.one_of(
    st.builds(lambda v: _key(SHAPE, 0) + encode_varint(v), numbers),
    st.builds(
        lambda vs: _delimited(SHAPE, b"".join(map(encode_varint, vs))),
        st.lists(numbers, max_size=3),
    ),
)
tensor = st.lists(
    st.one_of(shape_parts, st.just(_delimited(3, b"xy")), st.just(_key(1, 0) + b"\x01"), unknown),
    max_size=4,
).map(b"".join)
entry = st.lists(
    st.one_of(
        st.builds(lambda k: _delimited(1, k), st.sampled_from([b"a", b"b", b"", b"\xc3\xa9"])),
        st.builds(lambda t: _delimited(2, t), tensor),
        unknown,
    ),
    max_size=4,
).map(b"".join)
MODEL = pb.StepRequest.MODEL_FIELD_NUMBER


@pytest.mark.parametrize(
    "data",
    [
        _delimited(MODEL, b"first") + _delimited(5, b"") + _delimited(MODEL, b"second"),
        _delimited(5, b""),
        pb.StepRequest(model="mnist_mlp", new_version=3).SerializeToString(),
    ],
    ids=["the last one", "none", "among other fields"],
)
def test_a_steps_model_is_the_one_protobuf_parses(data: bytes) -> None:
    assert declared_model(data, MODEL) == pb.StepRequest.FromString(data).model


def test_a_model_name_protobuf_refuses_is_not_read() -> None:
    assert declared_model(_delimited(MODEL, b"\xff"), MODEL) is None
    assert declared_model(_delimited(MODEL, b"ab")[:-1], MODEL) is None


field = st.one_of(
    unknown,
    st.builds(lambda t: _delimited(INPUTS, t), tensor),
    st.builds(lambda e: _delimited(NAMED, e), entry),
)


@settings(max_examples=500, deadline=None)
@given(st.lists(field, max_size=12), st.integers(0, 14))
def test_a_message_holds_over_a_bound_as_its_top_level_fields_count(
    fields: list[bytes], limit: int
) -> None:
    """However the fields nest (tensors, map entries): only the top level counts."""
    assert holds_over(b"".join(fields), limit) == (len(fields) > limit)


def test_a_step_requests_batch_holds_over_a_bound_in_its_field() -> None:
    names = [f"v{i}" for i in range(10)]
    many = pb.StepRequest(model="m", batch=pb.GradientsRequest(variables=names))
    few = pb.StepRequest(model="m", batch=pb.GradientsRequest(variables=names[:3]))
    batch = pb.StepRequest.BATCH_FIELD_NUMBER
    assert holds_over(many.SerializeToString(), 5, batch)
    assert not holds_over(many.SerializeToString(), 5)
    assert not holds_over(few.SerializeToString(), 5, batch)


def test_a_group_holds_over_any_bound() -> None:
    """An empty group (field 99) in front of the fields: the parser takes it and reads
    on, so a reading that stopped there would let any number of fields through."""
    data = _key(99, 3) + _key(99, 4) + _key(REQUEST_ID, 0) + encode_varint(1)
    assert pb.GradientsRequest.FromString(data).request_id == 1
    assert holds_over(data, 100)


def test_a_step_requests_batch_sent_in_parts_counts_as_one() -> None:
    """Protobuf merges the parts into one batch: their fields count together."""
    part = pb.GradientsRequest(variables=["a", "b", "c"]).SerializeToString()
    batch = pb.StepRequest.BATCH_FIELD_NUMBER
    data = b"".join(_delimited(batch, part) for _ in range(4))
    assert len(pb.StepRequest.FromString(data).batch.variables) == 12
    assert holds_over(data, 11, batch)
    assert not holds_over(data, 12, batch)


def test_bytes_ending_mid_field_hold_over_no_bound() -> None:
    """The parser refuses them; reading counts only what it could read."""
    data = _key(REQUEST_ID, 0) + encode_varint(1) + _delimited(7, b"abc")[:-1]
    assert not holds_over(data, 2)


HEADER, HEADER_MODEL = pb.WeightsMessage.HEADER_FIELD_NUMBER, pb.WeightsHeader.MODEL_FIELD_NUMBER


def test_a_headers_model_is_read_before_more_fields_than_a_reader_reads() -> None:
    specs = [tensor_pb2.TensorSpec(name=f"t{i}", shape=[1]) for i in range(MAX_SCANNED + 10)]
    header = pb.WeightsHeader(model="mnist_mlp", tensors=specs)
    data = pb.WeightsMessage(header=header).SerializeToString()
    assert first_nested_string(data, HEADER, HEADER_MODEL) == "mnist_mlp"


@pytest.mark.parametrize(
    "data",
    [
        pb.WeightsMessage(chunk=tensor_pb2.TensorChunk(data=b"x")).SerializeToString(),
        _delimited(HEADER, _delimited(HEADER_MODEL, b"\xff")),
        _delimited(HEADER, _delimited(HEADER_MODEL, b"ab")[:-1]),
    ],
    ids=["no header", "not UTF-8", "cut short"],
)
def test_a_header_naming_no_readable_model_names_none(data: bytes) -> None:
    assert first_nested_string(data, HEADER, HEADER_MODEL) is None
