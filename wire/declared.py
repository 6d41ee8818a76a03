"""What a request's bytes declare, read without parsing it: a gradients request's tensors'
batch sizes and its id, a step's model, exactly as protobuf (upb) would parse them, and
whether it holds more fields than any request to the server's models could.

So the server refuses a batch over its limit before parsing the request (a 57 MiB
request took upb 50-120 ms to parse, holding the GIL). Where the bytes cannot be read
but by parsing, Unreadable: the parser decides.
"""

from __future__ import annotations

from collections.abc import Iterator

from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2
from pergrad.wire.fields import (
    LENGTH_DELIMITED,
    VARINT,
    Field,
    Group,
    OverBudget,
    Reader,
    Unreadable,
)
from pergrad.wire.text import quoted

_INPUTS = pb.GradientsRequest.INPUTS_FIELD_NUMBER
_LABELS = pb.GradientsRequest.LABELS_FIELD_NUMBER
_NAMED_INPUTS = pb.GradientsRequest.NAMED_INPUTS_FIELD_NUMBER
_REQUEST_ID = pb.GradientsRequest.REQUEST_ID_FIELD_NUMBER
_SHAPE = tensor_pb2.Tensor.SHAPE_FIELD_NUMBER
_ENTRY_KEY, _ENTRY_VALUE = 1, 2  # a map entry's fields, in every protobuf map


def declared_batches(data: bytes, in_field: int = 0) -> Iterator[tuple[str, int]]:
    """(what, batch size) of each tensor of the gradients request in `data` (or, with
    `in_field`, in that field of the message in `data`), named as the server's errors
    name them: "inputs", "labels", "inputs['name']"."""
    reader = Reader(data)
    spans = (
        [(f.start, f.end) for f in reader.length_delimited(in_field)]
        if in_field
        else [(0, len(data))]
    )
    tensors: dict[int, list[Field]] = {_INPUTS: [], _LABELS: []}
    entries: dict[str, Field] = {}
    for start, end in spans:
        for field in reader.fields(start, end):
            if field.wire_type != LENGTH_DELIMITED:
                continue
            if field.number in tensors:
                tensors[field.number].append(field)
            elif field.number == _NAMED_INPUTS and _kept(reader, field):
                entries[_entry_key(reader, field)] = field
    for what, number in (("inputs", _INPUTS), ("labels", _LABELS)):
        batch = _first_dimension(reader, tensors[number])
        if batch is not None:
            yield what, batch
    for name, entry in entries.items():
        values = reader.length_delimited(_ENTRY_VALUE, entry.start, entry.end)
        batch = _first_dimension(reader, values)
        if batch is not None:
            yield f"inputs[{quoted(name)}]", batch


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


def declared_request_id(data: bytes) -> int:
    """The request's `request_id` (uint64: the last one sent, its low 64 bits)."""
    fields = Reader(data).fields()
    ids = [f.value for f in fields if f.number == _REQUEST_ID and f.wire_type == VARINT]
    return ids[-1] & ((1 << 64) - 1) if ids else 0


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


def _kept(reader: Reader, entry: Field) -> bool:
    """Whether upb keeps a map entry: one holding any field but its key and value, each
    length-delimited, is kept among the unknown fields instead, out of the map."""
    return all(
        f.number in (_ENTRY_KEY, _ENTRY_VALUE) and f.wire_type == LENGTH_DELIMITED
        for f in reader.fields(entry.start, entry.end)
    )


def _first_dimension(reader: Reader, parts: list[Field]) -> int | None:
    """A tensor's first dimension: its parts merge, so their shapes follow each other."""
    for part in parts:
        first = reader.first_element(_SHAPE, part.start, part.end)
        if first is not None:
            return first
    return None


def _entry_key(reader: Reader, entry: Field) -> str:
    """A map entry's key (the last one it holds, as protobuf reads it)."""
    keys = reader.length_delimited(_ENTRY_KEY, entry.start, entry.end)
    if not keys:
        return ""
    try:
        return bytes(reader.data[keys[-1].start : keys[-1].end]).decode()
    except UnicodeDecodeError as err:
        raise Unreadable("a key that is not UTF-8") from err
