"""Requests refused from their bytes before they are parsed: the bounds leave room for
every legitimate request."""

from __future__ import annotations

from pergrad.server.admission.unparsed import Unparsed
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from pergrad.server.models.registry import ModelRegistry, serve_model
from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.wire.codec import wire_dtype
from pergrad.wire.fields import encode_varint


def _field(number: int, payload: bytes) -> bytes:
    return encode_varint(number << 3 | 2) + encode_varint(len(payload)) + payload


def _widest_header(name: str, variables: list[tuple[str, int, tuple[int, ...]]]) -> bytes:
    """A WeightsMessage whose header has every field at its widest: versions of -1 (ten
    bytes each) and every shape sent unpacked, one tag per dimension, as proto3 allows."""
    specs = b"".join(
        _field(
            3,
            _field(1, spec.encode())
            + b"\x10"
            + encode_varint(dtype)
            + b"".join(b"\x18" + encode_varint(d) for d in shape),
        )
        for spec, dtype, shape in variables
    )
    header = _field(1, name.encode()) + b"\x10" + encode_varint(-1) + specs
    header += b"\x20" + encode_varint(-1) + _field(5, b"0" * 32)
    return _field(1, header)


def test_a_legitimate_header_at_its_widest_is_not_refused_on_size() -> None:
    """The bound on a SetWeights header's size leaves room for any client's encoding of
    a served model's header."""
    name = "mnist_mlp"
    served = serve_model(name, BUILTIN_MODELS[name](), loss=LOSS, jit_compile=False)
    unparsed = Unparsed(ModelRegistry([served]))
    variables = [(v.name, wire_dtype(v.dtype), v.shape) for v in served.engine.variables]
    data = _widest_header(name, variables)
    parsed = pb.WeightsMessage.FromString(data).header
    assert [tuple(t.shape) for t in parsed.tensors] == [shape for _, _, shape in variables]
    assert parsed.model_version == parsed.new_version == -1
    assert unparsed.oversized_header(data) is None
    padded = data + _field(1, _field(99, b"x" * 8192))  # the header grown past 8 KiB
    assert unparsed.oversized_header(padded) is not None
