"""A message's top-level fields read from its wire form, without parsing the message.

Parsing a message builds every submessage it holds: a SetWeights header declaring
60,000 tensor specs took upb 5 ms, with the GIL held, before its count could be refused
(`benchmarks/attacks.py` row 10: an honest call 11.3x slower under such callers, 3.3x
once refused by its size, read here first).
"""

from __future__ import annotations

# Top-level fields looked at, at most: a well-formed message of the types checked has one
# or two, and a message of many small fields must not make this loop the costly part.
MAX_FIELDS = 8
_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at `at` and the offset after it (ValueError where none ends)."""
    value = shift = 0
    while shift < 70:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if byte < 0x80:
            return value, at
        shift += 7
    raise ValueError("varint of over 10 bytes")


def field_bytes(data: bytes, number: int) -> int:
    """The bytes of the length-delimited top-level field `number` (summed where it comes
    more than once). Bytes left unread (past MAX_FIELDS fields, or after a group) count
    as that field's, so that no padding in front of it hides it; bytes that end
    mid-field count what was read, and the parser refuses them."""
    total, at, end = 0, 0, len(data)
    try:
        for _ in range(MAX_FIELDS):
            if at >= end:
                return total
            key, at = _varint(data, at)
            wire_type = key & 7
            if wire_type == _VARINT:
                at = _varint(data, at)[1]
            elif wire_type == _FIXED64:
                at += 8
            elif wire_type == _FIXED32:
                at += 4
            elif wire_type == _LENGTH_DELIMITED:
                length, at = _varint(data, at)
                total += length if key >> 3 == number else 0
                at += length
            else:
                break
    except (IndexError, ValueError):
        return total
    return total + max(0, end - at)
