"""Chunked requests: how a client splits a request (`in_chunks`) and a server fills it back
(`Chunked`), by the proto's one numbering of chunked tensors."""

from __future__ import annotations

import numpy as np
import pytest

from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2
from pergrad.wire.catalogue import CATALOGUE
from pergrad.wire.chunked_requests import (
    Chunked,
    Key,
    Request,
    Whole,
    in_chunks,
    is_chunk,
    tensor_keys,
    tensor_name,
)
from pergrad.wire.codec import CodecError, encode_tensor
from pergrad.wire.messages import gradients_request

KIB = 1 << 10


def _request(inputs: int, labels: int, **references: int) -> pb.GradientsRequest:
    """A request of float32 inputs and int64 labels of about these bytes, and references."""
    request = pb.GradientsRequest(
        model="m",
        inputs=encode_tensor(np.arange(inputs // 4, dtype=np.float32)),
        labels=encode_tensor(np.arange(labels // 8, dtype=np.int64)),
    )
    for name, nbytes in references.items():
        request.reference[name].CopyFrom(encode_tensor(np.full(nbytes // 4, 7, np.float32)))
    return request


def _parsed(parts: list) -> list:
    """The parts as a receiver parses them (chunks come serialized, encoded by hand)."""
    kind = type(parts[0])
    return [kind.FromString(p) if isinstance(p, bytes) else p for p in parts]


def _filled(parts: list) -> Whole:
    """The request a receiver makes of the parts, each chunk message with its size."""
    header, *chunks = _parsed(parts)
    whole = Chunked(header)
    for message, sent in zip(chunks, parts[1:], strict=True):
        whole.add(message, len(sent))
    assert whole.complete
    return whole.whole()


def _tensors(request: Whole) -> dict[Key, np.ndarray]:
    """Every tensor of the request as the server reads it, by key."""
    return {key: request.array(t, key) for key, t in tensor_keys(request.message)}


def _without_bytes(message: Request) -> Request:
    """The message with every tensor's bytes left out, none marked chunked."""
    copy = type(message)()
    copy.CopyFrom(message)
    for _, tensor in tensor_keys(copy):
        tensor.content, tensor.chunked = b"", False
    return copy


def assert_same_request(got: Whole, sent: Request) -> None:
    """The request as sent, field for field and byte for byte."""
    tensors, want = _tensors(got), _tensors(Whole(sent))
    assert list(tensors) == list(want)
    for name, array in tensors.items():
        assert (array.dtype, array.shape) == (want[name].dtype, want[name].shape), name
        assert array.tobytes() == want[name].tobytes(), name
    assert _without_bytes(got.message) == _without_bytes(sent)


def test_a_request_within_the_inline_bytes_travels_as_one_message() -> None:
    request = _request(100 * KIB, 8 * KIB)
    assert in_chunks(request, inline_bytes=200 * KIB) == [request]


def test_the_largest_tensors_are_chunked_until_the_rest_fit() -> None:
    request = _request(300 * KIB, 8 * KIB, a=200 * KIB, b=50 * KIB)
    header, *chunks = _parsed(in_chunks(request, inline_bytes=100 * KIB, chunk_bytes=64 * KIB))
    chunked = [tensor_name(k) for k, tensor in tensor_keys(header) if tensor.chunked]
    assert chunked == ["inputs", "reference['a']"]
    assert all(is_chunk(c) and len(c.ListFields()) == 1 for c in chunks)
    assert sorted({c.chunk.tensor for c in chunks}) == [0, 1]  # numbered in the proto's order


def test_a_request_in_chunks_is_filled_back_byte_for_byte() -> None:
    request = _request(300 * KIB, 200 * KIB, zz=120 * KIB, aa=130 * KIB)
    parts = in_chunks(request, inline_bytes=10 * KIB, chunk_bytes=64 * KIB)
    assert len(parts) > 4
    assert_same_request(_filled(parts), request)


def test_chunked_tensors_reach_the_server_as_read_only_arrays_not_through_the_message() -> None:
    """Filling a bytes field and reading it back would copy a large request twice."""
    whole = _filled(in_chunks(_request(300 * KIB, 8 * KIB), inline_bytes=100 * KIB))
    assert whole.message.inputs.chunked and not whole.message.inputs.content
    assert list(whole.arrays) == [("inputs", None)]
    assert not whole.array(whole.message.inputs, ("inputs", None)).flags.writeable


def _built(inputs: int, labels: int) -> Whole:
    """A request as the client builds it: its tensors arrays beside its message."""
    x = np.arange(inputs // 4, dtype=np.float32)
    y = np.arange(labels // 8, dtype=np.int64)
    return gradients_request("m", x, y, reduction=CATALOGUE.get("norms"), options={})


def test_a_built_request_in_chunks_is_the_request_inline_byte_for_byte() -> None:
    built = _built(300 * KIB, 40 * KIB)
    parts = in_chunks(built, inline_bytes=100 * KIB, chunk_bytes=64 * KIB)
    header = _parsed(parts)[0]
    assert [tensor_name(k) for k, t in tensor_keys(header) if t.chunked] == ["inputs"]
    assert len(header.labels.content) == 40 * KIB  # the smaller tensor inline, from its array
    assert_same_request(_filled(parts), built.inline())


def test_a_built_request_that_fits_travels_as_the_one_message_it_makes() -> None:
    built = _built(8 * KIB, 8 * KIB)
    assert in_chunks(built) == [built.inline()]


def test_splitting_a_built_request_leaves_it_unchanged_for_a_retry() -> None:
    built = _built(300 * KIB, 8 * KIB)
    message, arrays = built.message.SerializeToString(), dict(built.arrays)
    first = in_chunks(built, inline_bytes=KIB)
    assert built.message.SerializeToString() == message and built.arrays == arrays
    assert in_chunks(built, inline_bytes=KIB) == first


def test_a_built_batch_within_a_step_sends_the_step_of_that_batch() -> None:
    """`within` puts a request in a step's field with its arrays; `part` takes it out."""
    built = _built(300 * KIB, 8 * KIB)
    step = built.within(pb.StepRequest(model="m", learning_rate=0.1), "batch")
    expected = pb.StepRequest(model="m", learning_rate=0.1, batch=built.inline())
    assert_same_request(_filled(in_chunks(step, inline_bytes=KIB)), expected)
    assert step.part("batch").arrays == built.arrays


def test_map_keys_alike_in_their_first_hundred_characters_keep_their_own_bytes() -> None:
    """Errors cut a long key short (`quoted`); a tensor's array is kept by its whole key."""
    step = pb.StepRequest(model="m", expected_batch_size=1)
    sums = {f"{'a' * 120}/{end}": np.full(64 * KIB, i, np.float32) for i, end in enumerate("qv")}
    for name, total in sums.items():
        step.gradient_sum[name].CopyFrom(encode_tensor(total))
    whole = _filled(in_chunks(step, inline_bytes=KIB))
    for name, total in sums.items():
        got = whole.array(whole.message.gradient_sum[name], ("gradient_sum", name))
        np.testing.assert_array_equal(got, total)


def test_a_built_request_keyed_by_string_subclasses_sends_every_array() -> None:
    """numpy's str_ (and a StrEnum) repr otherwise than the string protobuf keeps."""
    x = {np.str_("pixels"): np.ones((2, 300 * KIB // 8), np.float32)}
    dot = CATALOGUE.get("dot")
    built = gradients_request(
        "m",
        x,
        np.zeros(2, np.int32),
        reduction=dot,
        options={"reference": {np.str_("w"): np.ones((1, 4))}},
    )
    assert_same_request(_filled(in_chunks(built, inline_bytes=KIB)), built.inline())


def test_splitting_leaves_the_request_unchanged_for_a_retry() -> None:
    request = _request(300 * KIB, 8 * KIB)
    copy = pb.GradientsRequest()
    copy.CopyFrom(request)
    in_chunks(request, inline_bytes=KIB)
    assert request == copy


def test_a_step_numbers_its_batch_tensors_before_its_gradient_sum() -> None:
    step = pb.StepRequest(model="m", batch=_request(64 * KIB, 64 * KIB))
    step.gradient_sum["w"].CopyFrom(encode_tensor(np.ones(16 * KIB, np.float32)))
    assert [tensor_name(k) for k, _ in tensor_keys(step)] == [
        "batch.inputs",
        "batch.labels",
        "gradient_sum['w']",
    ]
    assert_same_request(_filled(in_chunks(step, inline_bytes=KIB, chunk_bytes=64 * KIB)), step)


def test_declared_bytes_are_known_before_any_chunk() -> None:
    header, *_ = in_chunks(_request(300 * KIB, 80 * KIB), inline_bytes=KIB)
    assert Chunked(header).nbytes == 300 * KIB + 80 * KIB


def _header(**tensor: object) -> pb.GradientsRequest:
    return pb.GradientsRequest(model="m", inputs=tensor_pb2.Tensor(**tensor))


def test_a_shape_no_array_could_hold_is_refused_from_the_header() -> None:
    with pytest.raises(CodecError, match="2\\^40"):
        Chunked(_header(dtype=1, shape=[1 << 30, 1 << 30], chunked=True))


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (pb.GradientsRequest(chunk=tensor_pb2.TensorChunk()), "a chunk where a request was due"),
        (
            pb.GradientsRequest(
                inputs=tensor_pb2.Tensor(dtype=1, shape=[1], content=b"1234", chunked=True)
            ),
            "chunked, yet holds 4 bytes",
        ),
    ],
)
def test_a_first_message_out_of_place_is_refused(message: pb.GradientsRequest, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        Chunked(message)


def _chunk(tensor: int, offset: int, data: bytes, **beside: object) -> pb.GradientsRequest:
    return pb.GradientsRequest(
        chunk=tensor_pb2.TensorChunk(tensor=tensor, offset=offset, data=data), **beside
    )


@pytest.mark.parametrize(
    ("chunks", "match"),
    [
        ([_chunk(0, 4, b"abcd")], "out of order"),
        ([_chunk(0, 0, b"x" * 12)], "past 8"),
        ([_chunk(1, 0, b"abcd")], "only 1 declared"),
        ([_chunk(0, 0, b"abcd", model="m")], "holding only `chunk`"),
        ([pb.GradientsRequest(model="another")], "holding only `chunk`"),
        ([_chunk(0, 0, b"abcd")], "a chunk of 4 bytes: each chunk but a tensor's last"),
        ([], "truncated: 0 of 8 bytes"),
    ],
)
def test_a_chunk_out_of_place_or_missing_is_refused(chunks: list, match: str) -> None:
    parts = Chunked(_header(dtype=1, shape=[2], chunked=True))
    with pytest.raises(CodecError, match=match):
        for chunk in chunks:
            parts.add(chunk)
        parts.whole()


def test_a_message_of_another_kind_is_whole() -> None:
    parts = Chunked(pb.ListModelsRequest())
    assert (parts.nbytes, parts.complete) == (0, True)


def test_the_batches_declared_in_chunks_are_the_example_tensors() -> None:
    step = pb.StepRequest(model="m", batch=_request(300 * KIB, 160 * KIB))
    step.gradient_sum["w"].CopyFrom(encode_tensor(np.ones((40, 1024), np.float32)))
    header, *_ = _parsed(in_chunks(step, inline_bytes=KIB))
    assert Chunked(header).batches() == [
        ("batch.inputs", 300 * KIB // 4),
        ("batch.labels", 160 * KIB // 8),
    ]


def test_a_chunk_message_holding_more_than_its_chunk_is_refused() -> None:
    """Bytes besides the chunk's (fields the server does not know) would pass through it
    uncharged: a message holding more than CHUNK_FIELDS_BYTES of them is refused."""
    header, chunk = in_chunks(_request(256 * KIB, 8), inline_bytes=KIB, chunk_bytes=1 << 20)
    padding = b"\x9a\x06" + bytes([0x80, 0x08]) + bytes(1024)  # field 99: 1 KiB
    padded = chunk + padding
    assert pb.GradientsRequest.FromString(padded).ListFields() == [
        (
            pb.GradientsRequest.DESCRIPTOR.fields_by_name["chunk"],
            pb.GradientsRequest.FromString(chunk).chunk,
        )
    ]
    whole = Chunked(header)
    with pytest.raises(CodecError, match=f"{len(padded)} bytes holds {256 * KIB} of data"):
        whole.add(pb.GradientsRequest.FromString(padded), len(padded))
    whole.add(pb.GradientsRequest.FromString(chunk), len(chunk))
    assert whole.complete
