"""GradientsResponse chunk messages encoded and decoded by hand: one copy of the data.

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

from pergrad.v1 import gradient_service_pb2 as pb

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class RawChunk(NamedTuple):
    tensor: int
    offset: int
    data: memoryview


class Part(NamedTuple):
    """One decoded GradientsResponse: either `header` or `chunk` is set."""

    request_id: int
    header: pb.ResultHeader | None
    chunk: RawChunk | None


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _field(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def encode_chunk(request_id: int, tensor: int, offset: int, data: memoryview) -> bytes:
    """A serialized GradientsResponse carrying one TensorChunk (fields at default omitted)."""
    inner = b""
    if tensor:
        inner += _field(1, _VARINT) + _varint(tensor)
    if offset:
        inner += _field(2, _VARINT) + _varint(offset)
    size = len(data)
    head = inner + _field(3, _LEN) + _varint(size)
    outer = _field(1, _VARINT) + _varint(request_id) if request_id else b""
    outer += _field(3, _LEN) + _varint(len(head) + size)
    return b"".join((outer, head, data))


def _read_varint(buffer: memoryview, position: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if position >= len(buffer):
            raise ValueError("truncated varint")
        byte = buffer[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 64 bits")


def _fields(buffer: memoryview) -> list[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of every field in a serialized message."""
    fields, position = [], 0
    while position < len(buffer):
        key, position = _read_varint(buffer, position)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, position = _read_varint(buffer, position)
        elif wire_type == _LEN:
            size, position = _read_varint(buffer, position)
            if position + size > len(buffer):
                raise ValueError("length-delimited field runs past the message")
            value, position = buffer[position : position + size], position + size
        elif wire_type in (_I64, _I32):
            width = 8 if wire_type == _I64 else 4
            value, position = (
                int.from_bytes(buffer[position : position + width], "little"),
                (position + width),
            )
        else:
            raise ValueError(f"unsupported wire type {wire_type}")
        fields.append((number, wire_type, value))
    if position != len(buffer):
        raise ValueError("truncated message")
    return fields


def decode_response(message: bytes) -> Part:
    """A serialized GradientsResponse, its chunk data a view into `message` (no copy)."""
    request_id, header, chunk = 0, None, None
    for number, wire_type, value in _fields(memoryview(message)):
        if number == 1 and wire_type == _VARINT:
            request_id = value
        elif number == 2 and wire_type == _LEN:
            header = pb.ResultHeader.FromString(bytes(value))
        elif number == 3 and wire_type == _LEN:
            chunk = _decode_chunk(value)
    return Part(request_id, header, chunk)


def _decode_chunk(buffer: memoryview) -> RawChunk:
    tensor, offset, data = 0, 0, memoryview(b"")
    for number, wire_type, value in _fields(buffer):
        if number == 1 and wire_type == _VARINT:
            tensor = value
        elif number == 2 and wire_type == _VARINT:
            offset = value
        elif number == 3 and wire_type == _LEN:
            data = value
    return RawChunk(tensor, offset, data)


def serialize(message: pb.GradientsResponse | bytes) -> bytes:
    """gRPC response serializer that lets pre-encoded messages through."""
    return message if isinstance(message, bytes) else message.SerializeToString()


def identity(message: bytes) -> bytes:
    """gRPC response deserializer that leaves decoding to `decode_response`."""
    return message
