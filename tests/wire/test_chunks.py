"""The hand-written chunk encoding agrees with protobuf's, both ways."""

from __future__ import annotations

import pytest

from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2
from pergrad.wire.chunks import decode_response, encode_chunk

CASES = [
    (0, 0, 0, b""),
    (1, 0, 0, b"x"),
    (7, 3, 1 << 20, bytes(range(256)) * 4),
    (2**40, 300, 2**35, b"\x00" * 1000),
]


@pytest.mark.parametrize(("request_id", "tensor", "offset", "data"), CASES)
def test_encoded_chunk_parses_as_the_protobuf_message(request_id, tensor, offset, data) -> None:
    message = pb.GradientsResponse.FromString(
        encode_chunk(request_id, tensor, offset, memoryview(data))
    )
    assert message.request_id == request_id
    assert message.WhichOneof("part") == "chunk"
    assert (message.chunk.tensor, message.chunk.offset, message.chunk.data) == (
        tensor,
        offset,
        data,
    )


@pytest.mark.parametrize(("request_id", "tensor", "offset", "data"), CASES)
def test_protobuf_chunk_decodes_to_the_same_fields(request_id, tensor, offset, data) -> None:
    chunk = tensor_pb2.TensorChunk(tensor=tensor, offset=offset, data=data)
    part = decode_response(
        pb.GradientsResponse(request_id=request_id, chunk=chunk).SerializeToString()
    )
    assert part.request_id == request_id and part.header is None
    assert (part.chunk.tensor, part.chunk.offset, bytes(part.chunk.data)) == (tensor, offset, data)


def test_header_decodes_through_protobuf() -> None:
    header = pb.ResultHeader(model="m", model_version=3, batch_size=5, server="r1")
    part = decode_response(pb.GradientsResponse(request_id=9, header=header).SerializeToString())
    assert part.request_id == 9 and part.header == header and part.chunk is None


@pytest.mark.parametrize("broken", [b"\x1a\x05abc", b"\x08", b"\x0f"])
def test_truncated_or_malformed_messages_are_refused(broken: bytes) -> None:
    with pytest.raises(ValueError):
        decode_response(broken)
