import pytest

from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2
from pergrad.wire.fields import MAX_FIELDS, MAX_SCANNED, Reader, Unreadable, field_bytes

HEADER = pb.WeightsMessage.HEADER_FIELD_NUMBER


def _header(count: int) -> pb.WeightsHeader:
    specs = [tensor_pb2.TensorSpec(name=f"t{i}", dtype=1, shape=[1, 2]) for i in range(count)]
    return pb.WeightsHeader(model="mnist_mlp", model_version=-1, tensors=specs)


def test_a_field_counts_the_bytes_protobuf_gives_it() -> None:
    header = _header(300)
    data = pb.WeightsMessage(header=header).SerializeToString()
    assert field_bytes(data, HEADER) == header.ByteSize()


def test_other_fields_count_nothing() -> None:
    chunk = pb.WeightsMessage(chunk=tensor_pb2.TensorChunk(tensor=1, data=b"x" * 5000))
    assert field_bytes(chunk.SerializeToString(), HEADER) == 0


def test_a_field_sent_twice_counts_both_parts() -> None:
    """Protobuf merges the parts of a message field sent twice, so both are read."""
    first, second = _header(3), _header(40)
    data = b"".join(pb.WeightsMessage(header=h).SerializeToString() for h in (first, second))
    assert field_bytes(data, HEADER) == first.ByteSize() + second.ByteSize()
    assert len(pb.WeightsMessage.FromString(data).header.tensors) == 43


def test_fields_before_it_of_every_wire_type_are_stepped_over() -> None:
    """Unknown fields (a newer client's) of varint, fixed and length-delimited types."""
    unknown = bytes([0x78, 0x96, 0x01, 0x81, 0x01]) + b"\0" * 8 + bytes([0x8D, 0x01]) + b"\0" * 4
    unknown += bytes([0x92, 0x01, 3]) + b"abc"
    header = _header(5)
    data = unknown + pb.WeightsMessage(header=header).SerializeToString()
    assert pb.WeightsMessage.FromString(data).header == header
    assert field_bytes(data, HEADER) == header.ByteSize()


def test_bytes_past_the_first_fields_count_as_the_fields() -> None:
    """Padding of small fields in front cannot hide a header: what is not looked at
    counts as the header's."""
    small = bytes([0x78, 0x01])
    header = pb.WeightsMessage(header=_header(5)).SerializeToString()
    assert field_bytes(small * (MAX_FIELDS - 1) + header, HEADER) == _header(5).ByteSize()
    assert field_bytes(small * MAX_FIELDS + header, HEADER) == len(header)


def test_bytes_after_a_group_count_as_the_fields() -> None:
    """An empty group (field 15) that upb skips, in front of the header."""
    header = _header(5)
    data = bytes([0x7B, 0x7C]) + pb.WeightsMessage(header=header).SerializeToString()
    assert pb.WeightsMessage.FromString(data).header == header
    assert field_bytes(data, HEADER) >= header.ByteSize()


def test_bytes_that_end_mid_field_count_what_was_read() -> None:
    assert field_bytes(b"", HEADER) == 0
    assert field_bytes(b"\x0a", HEADER) == 0
    assert field_bytes(b"\x0a\x05ab", HEADER) == 5
    assert field_bytes(b"\xff" * 20, HEADER) == 0


def test_length_delimited_gives_each_part_in_order() -> None:
    first, second = _header(2), _header(3)
    data = b"".join(pb.WeightsMessage(header=h).SerializeToString() for h in (first, second))
    parts = Reader(data).length_delimited(HEADER)
    assert [data[p.start : p.end] for p in parts] == [
        first.SerializeToString(),
        second.SerializeToString(),
    ]


@pytest.mark.parametrize(
    "data",
    [
        b"\x0a\x05ab",  # a field's length past the end
        bytes([0x7B, 0x7C]),  # a group
        b"\xff" * 20,  # a varint of over 10 bytes
        bytes([0x78, 0x01]) * (MAX_SCANNED + 1),  # more fields than are read
    ],
    ids=["past the end", "group", "long varint", "too many fields"],
)
def test_bytes_that_cannot_be_read_without_parsing_are_unreadable(data: bytes) -> None:
    with pytest.raises(Unreadable):
        list(Reader(data).fields())
