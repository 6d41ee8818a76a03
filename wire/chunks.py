"""Chunk messages encoded (GradientsResponse's, and a request's in parts) and decoded
(GradientsResponse's) by hand: one copy of the data.

Building a `GradientsResponse(chunk=TensorChunk(data=...))` in Python copies a 1 MiB
chunk three times before gRPC sends it, and reading `.chunk.data` on the client copies it
again; at several hundred MB per result that halves the throughput. The protobuf wire
format of these two messages is fixed by `gradient_service.proto`, so the hot path writes
and reads it directly (tests check it against the generated classes); headers and every
other message still go through protobuf.

    GradientsResponse: 1 request_id varint, 2 header bytes, 3 chunk bytes
    TensorChunk:       1 tensor varint,     2 offset varint, 3 data bytes
"""

from __future__ import annotations

from typing import NamedTuple

from google.protobuf.message import Message

from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.fields import (
    LENGTH_DELIMITED,
    VARINT,
    Field,
    Reader,
    Unreadable,
    encode_varint,
)


class RawChunk(NamedTuple):
    tensor: int
    offset: int
    data: memoryview


class Part(NamedTuple):
    """One decoded GradientsResponse: either `header` or `chunk` is set."""

    request_id: int
    header: pb.ResultHeader | None
    chunk: RawChunk | None


def _field(number: int, wire_type: int) -> bytes:
    return encode_varint(number << 3 | wire_type)


def encode_chunk(request_id: int, tensor: int, offset: int, data: memoryview) -> bytes:
    """A serialized GradientsResponse carrying one TensorChunk (fields at default omitted)."""
    outer = _field(1, VARINT) + encode_varint(request_id) if request_id else b""
    return encode_chunk_in(3, tensor, offset, data, before=outer)


def encode_chunk_in(
    field: int, tensor: int, offset: int, data: memoryview | bytes, before: bytes = b""
) -> bytes:
    """A serialized message whose field number `field` is one TensorChunk, after the
    encoded fields `before`: a response's chunk, or a request's (`request_parts`)."""
    inner = b""
    if tensor:
        inner += _field(1, VARINT) + encode_varint(tensor)
    if offset:
        inner += _field(2, VARINT) + encode_varint(offset)
    size = len(data)
    head = inner + _field(3, LENGTH_DELIMITED) + encode_varint(size)
    outer = before + _field(field, LENGTH_DELIMITED) + encode_varint(len(head) + size)
    return b"".join((outer, head, data))


def _fields(message: memoryview) -> list[Field]:
    """Every field of a serialized message (`fields.Reader`); ValueError where its bytes
    are not one."""
    try:
        return list(Reader(message).fields())
    except Unreadable as err:
        raise ValueError(f"not a message: {err}") from None


def decode_response(message: bytes) -> Part:
    """A serialized GradientsResponse, its chunk data a view into `message` (no copy)."""
    request_id, header, chunk = 0, None, None
    view = memoryview(message)
    for field in _fields(view):
        if field.number == 1 and field.wire_type == VARINT:
            request_id = field.value
        elif field.number == 2 and field.wire_type == LENGTH_DELIMITED:
            header = pb.ResultHeader.FromString(bytes(view[field.start : field.end]))
        elif field.number == 3 and field.wire_type == LENGTH_DELIMITED:
            chunk = _decode_chunk(view[field.start : field.end])
    return Part(request_id, header, chunk)


def _decode_chunk(buffer: memoryview) -> RawChunk:
    tensor, offset, data = 0, 0, memoryview(b"")
    for field in _fields(buffer):
        if field.number == 1 and field.wire_type == VARINT:
            tensor = field.value
        elif field.number == 2 and field.wire_type == VARINT:
            offset = field.value
        elif field.number == 3 and field.wire_type == LENGTH_DELIMITED:
            data = buffer[field.start : field.end]
    return RawChunk(tensor, offset, data)


def serialize(message: Message | bytes) -> bytes:
    """gRPC serializer that lets pre-encoded messages through (a response's chunks, a
    request's)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def identity(message: bytes) -> bytes:
    """gRPC response deserializer that leaves decoding to `decode_response`."""
    return message
