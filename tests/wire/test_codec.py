"""The tensor codec: raw little-endian bytes in, the same array out, and loud failures."""

from __future__ import annotations

import numpy as np
import pytest

from pergrad.v1 import tensor_pb2 as pb
from pergrad.wire.codec import (
    CodecError,
    TensorAssembler,
    decode_tensor,
    encode_tensor,
    iter_chunks,
    tensor_spec,
    wire_bytes,
)


@pytest.mark.parametrize(
    "dtype", ["float32", "float64", "float16", "int32", "int64", "uint8", "bool"]
)
def test_encode_then_decode_gives_the_same_array(dtype: str) -> None:
    array = (np.arange(24) % 3).astype(dtype).reshape(2, 3, 4)
    decoded = decode_tensor(encode_tensor(array), what="x")
    assert decoded.dtype == array.dtype
    np.testing.assert_array_equal(decoded, array)


def test_big_endian_and_strided_arrays_travel_as_little_endian_rows() -> None:
    array = np.arange(12, dtype=">f4").reshape(3, 4).T
    tensor = encode_tensor(array)
    assert tensor.content == np.ascontiguousarray(array, dtype="<f4").tobytes()
    np.testing.assert_array_equal(decode_tensor(tensor, what="x"), array)


def test_byte_count_that_does_not_match_shape_is_refused() -> None:
    tensor = pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[2, 3], content=b"\0" * 20)
    with pytest.raises(CodecError, match=r"x: float32 \[2, 3\] needs 24 bytes, got 20"):
        decode_tensor(tensor, what="x")


def test_negative_dimension_is_refused() -> None:
    tensor = pb.Tensor(dtype=pb.DATA_TYPE_FLOAT32, shape=[-1, 3], content=b"")
    with pytest.raises(CodecError, match="negative dimension"):
        decode_tensor(tensor, what="x")


def test_unknown_dtype_is_refused_naming_the_supported_ones() -> None:
    tensor = pb.Tensor(dtype=99, shape=[1], content=b"\0\0")
    with pytest.raises(CodecError, match="unsupported dtype 99; supported: bfloat16, bool"):
        decode_tensor(tensor, what="x")


def _assembler_for(*arrays: np.ndarray) -> TensorAssembler:
    return TensorAssembler([tensor_spec(f"t{i}", a) for i, a in enumerate(arrays)])


def test_chunks_reassemble_interleaved_tensors() -> None:
    a, b = np.arange(1000, dtype=np.float32), np.arange(30, dtype=np.int64).reshape(5, 6)
    assembler = _assembler_for(a, b)
    chunks_a = list(iter_chunks(0, a, chunk_bytes=333))
    chunks_b = list(iter_chunks(1, b, chunk_bytes=50))
    for chunk in [c for pair in zip(chunks_a, chunks_b, strict=False) for c in pair]:
        assembler.add(chunk)
    for chunk in chunks_a[len(chunks_b) :]:
        assembler.add(chunk)
    assert assembler.complete
    got_a, got_b = assembler.arrays()
    np.testing.assert_array_equal(got_a, a)
    np.testing.assert_array_equal(got_b, b)


def test_row_slices_fill_their_place_in_the_whole_tensor() -> None:
    whole = np.arange(40, dtype=np.float32).reshape(10, 4)
    assembler = _assembler_for(whole)
    for start in range(0, 10, 3):
        for chunk in iter_chunks(0, whole[start : start + 3], start=start * 16, chunk_bytes=7):
            assembler.add(chunk)
    np.testing.assert_array_equal(assembler.arrays()[0], whole)


def test_out_of_order_chunk_is_refused() -> None:
    a = np.arange(100, dtype=np.float32)
    chunks = list(iter_chunks(0, a, chunk_bytes=64))
    assembler = _assembler_for(a)
    with pytest.raises(CodecError, match="out of order"):
        assembler.add(chunks[1])


def test_chunk_past_the_end_is_refused() -> None:
    assembler = _assembler_for(np.zeros(2, np.float32))
    with pytest.raises(CodecError, match="past 8"):
        assembler.add(pb.TensorChunk(tensor=0, offset=0, data=b"\0" * 12))


def test_chunk_for_an_undeclared_tensor_is_refused() -> None:
    assembler = _assembler_for(np.zeros(2, np.float32))
    with pytest.raises(CodecError, match="only 1 declared"):
        assembler.add(pb.TensorChunk(tensor=3, offset=0, data=b"\0"))


def test_truncated_tensor_is_refused_when_read() -> None:
    a = np.arange(100, dtype=np.float32)
    assembler = _assembler_for(a)
    assembler.add(next(iter_chunks(0, a, chunk_bytes=64)))
    assert not assembler.complete
    with pytest.raises(CodecError, match="'t0' truncated: 64 of 400 bytes"):
        assembler.arrays()


def test_inline_bytes_fill_every_tensor_in_order() -> None:
    a, b = np.arange(7, dtype=np.float32), np.arange(6, dtype=np.int64).reshape(2, 3)
    assembler = _assembler_for(a, b)
    assembler.add_inline(bytes(wire_bytes(a)) + bytes(wire_bytes(b)))
    got_a, got_b = assembler.arrays()
    np.testing.assert_array_equal(got_a, a)
    np.testing.assert_array_equal(got_b, b)


@pytest.mark.parametrize("extra", [-4, 4], ids=["short", "long"])
def test_inline_bytes_of_another_length_are_refused(extra: int) -> None:
    a = np.arange(7, dtype=np.float32)
    data = bytes(wire_bytes(a)) + b"\0" * max(extra, 0)
    with pytest.raises(CodecError):
        _assembler_for(a).add_inline(data[: len(data) + min(extra, 0)])
