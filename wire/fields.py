"""A message's fields read from its wire form, without parsing the message.

Parsing a message builds every submessage and copies every bytes field it holds, with
the GIL held: a SetWeights header declaring 60,000 tensor specs took upb 5 ms, a 57 MiB
gradients request 50-120 ms, before either could be refused (`benchmarks/attacks.py`
rows 10 and 8). Reading the few fields such a refusal needs steps over the rest by
their lengths.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

# Top-level fields `field_bytes` looks at, at most: a well-formed message of the types
# checked has one or two, and a message of many small fields must not make this loop
# the costly part.
MAX_FIELDS = 8
# Fields one `Reader` reads in all, at every level: a gradients request has one per
# option, tensor part and map entry (a `dot` reference per variable); 4 MiB of small
# fields, laid out to make the most of them, took 4-5 ms to read.
MAX_SCANNED = 4096
VARINT, _FIXED64, LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


class Unreadable(Exception):
    """Bytes that cannot be read without parsing them: a group, more fields than a
    reader reads, or bytes that end mid-field (the parser refuses those)."""


class Group(Unreadable):
    """A group: proto3 messages hold none, but the parser reads on past one."""


class OverBudget(Unreadable):
    """More fields than the reader reads."""


class Field(NamedTuple):
    number: int
    wire_type: int
    value: int  # a varint's value; a length-delimited field's length
    start: int  # where a length-delimited field's bytes start
    end: int  # the offset after the field


def _varint(data: bytes | memoryview, at: int) -> tuple[int, int]:
    """The varint at `at` and the offset after it (IndexError or ValueError where none
    ends)."""
    value = shift = 0
    while shift < 70:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7
    raise ValueError("varint of over 10 bytes")


def encode_varint(value: int) -> bytes:
    """`value` as a varint, as protobuf writes it (a negative int64 in ten bytes)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes([*out, value])


def _field(data: bytes | memoryview, at: int) -> Field:
    """The field starting at `at` (IndexError or ValueError where the bytes end or none
    starts; Unreadable at a group, whose end only parsing it finds)."""
    key, at = _varint(data, at)
    wire_type = key & 7
    value, start = 0, at
    if wire_type == VARINT:
        value, at = _varint(data, at)
    elif wire_type == _FIXED64:
        at += 8
    elif wire_type == _FIXED32:
        at += 4
    elif wire_type == LENGTH_DELIMITED:
        value, start = _varint(data, at)
        at = start + value
    else:
        raise Group(f"a group (field {key >> 3})")
    return Field(key >> 3, wire_type, value, start, at)


class Reader:
    """One message's bytes, read field by field, MAX_SCANNED fields in all however the
    reading nests (Unreadable past them), so no layout of small fields makes the
    reading cost more than a few ms."""

    def __init__(self, data: bytes | memoryview, budget: int = MAX_SCANNED) -> None:
        self.data = data
        self._budget = self._left = budget

    def fields(self, start: int = 0, end: int | None = None) -> Iterator[Field]:
        """The fields of the message in data[start:end], in order."""
        end = len(self.data) if end is None else end
        at = start
        while at != end:
            if not self._left:
                raise OverBudget(f"over {self._budget} fields")
            self._left -= 1
            try:
                field = _field(self.data, at)
            except (IndexError, ValueError) as err:
                raise Unreadable(str(err) or "bytes that end mid-field") from err
            if field.end > end:
                raise Unreadable("bytes that end mid-field")
            yield field
            at = field.end

    def length_delimited(self, number: int, start: int = 0, end: int | None = None) -> list[Field]:
        """Each length-delimited field `number` of data[start:end], in order (protobuf
        merges the parts of a message field sent more than once)."""
        found = self.fields(start, end)
        return [f for f in found if f.number == number and f.wire_type == LENGTH_DELIMITED]


def field_bytes(data: bytes, number: int) -> int:
    """The bytes of the length-delimited top-level field `number` (summed where it comes
    more than once), looking at MAX_FIELDS fields at most. Bytes left unread (past them,
    or after a group) count as that field's, so that no padding in front of it hides it;
    bytes that end mid-field count what was read, and the parser refuses them."""
    total, at, end = 0, 0, len(data)
    try:
        for _ in range(MAX_FIELDS):
            if at >= end:
                return total
            field = _field(data, at)
            if field.wire_type == LENGTH_DELIMITED and field.number == number:
                total += field.value
            at = field.end
    except Unreadable:
        pass
    except (IndexError, ValueError):
        return total
    return total + max(0, end - at)
