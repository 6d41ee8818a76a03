"""What a request's bytes declare, read without parsing it, exactly as protobuf (upb)
would parse them: whether it holds more fields than any request to the server's models
could (parsing many small fields holds the GIL ~1 us each), and the model it names (so
that a refused update still counts for its model). Where the bytes cannot be read but by
parsing, the parser decides.
"""

from __future__ import annotations

from pergrad.wire.fields import LENGTH_DELIMITED, Group, OverBudget, Reader, Unreadable


def holds_over(data: bytes, limit: int, in_field: int = 0) -> bool:
    """Whether the message in `data` holds over `limit` fields at its top level, or, with
    `in_field`, so does the message its fields `in_field` make (protobuf merges them into
    one): read field by field, no further than that. A group counts as over (proto3
    messages hold none, and the parser reads on past one); bytes that end mid-field say
    no: the parser refuses them."""
    try:
        spans = [
            (f.start, f.end)
            for f in Reader(data, budget=limit).fields()
            if f.number == in_field and f.wire_type == LENGTH_DELIMITED
        ]
        merged = Reader(data, budget=limit)  # one budget for every part of the field
        for start, end in spans:
            for _ in merged.fields(start, end):
                pass
    except (Group, OverBudget):
        return True
    except Unreadable:
        return False
    return False


def declared_model(data: bytes, number: int) -> str | None:
    """String field `number` (a model's name) of the message in `data`: the last one
    sent, as protobuf keeps it where it parses the message; None where the bytes cannot
    be read but by parsing, or the name is not UTF-8."""
    try:
        names = Reader(data).length_delimited(number)
        return data[names[-1].start : names[-1].end].decode() if names else ""
    except (Unreadable, UnicodeDecodeError):
        return None


def first_nested_string(data: bytes, outer: int, inner: int) -> str | None:
    """String field `inner` of message field `outer` of the message in `data`, the first
    of each sent, read no further: a header too large to read whole still names its model
    (protobuf keeps the last, so a message sending two could name either). None where
    none is read or it is not UTF-8."""
    reader = Reader(data)
    try:
        for field in reader.fields():
            if field.number != outer or field.wire_type != LENGTH_DELIMITED:
                continue
            for nested in reader.fields(field.start, field.end):
                if nested.number == inner and nested.wire_type == LENGTH_DELIMITED:
                    return data[nested.start : nested.end].decode()
            return None
    except (Unreadable, UnicodeDecodeError):
        return None
    return None
