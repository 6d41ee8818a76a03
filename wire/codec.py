"""numpy <-> wire tensors: raw little-endian row-major bytes with a dtype and a shape.

The one codec of the project, for the client and the server. Large tensors travel
as a list of `TensorSpec`s followed by `TensorChunk`s; `TensorAssembler` allocates each
tensor once and copies every chunk straight into place.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence

import numpy as np

from pergrad.v1 import tensor_pb2 as pb
from pergrad.wire.casting import dtype_named
from pergrad.wire.chunks import RawChunk

DEFAULT_CHUNK_BYTES = 1 << 20

# numpy's names (little-endian on every platform numpy's wheels serve); bfloat16 is ml_dtypes'.
_WIRE_DTYPES: dict[str, pb.DataType] = {
    "float32": pb.DATA_TYPE_FLOAT32,
    "float64": pb.DATA_TYPE_FLOAT64,
    "float16": pb.DATA_TYPE_FLOAT16,
    "bfloat16": pb.DATA_TYPE_BFLOAT16,
    "int32": pb.DATA_TYPE_INT32,
    "int64": pb.DATA_TYPE_INT64,
    "uint8": pb.DATA_TYPE_UINT8,
    "bool": pb.DATA_TYPE_BOOL,
}
_NAMES: dict[int, str] = {code: name for name, code in _WIRE_DTYPES.items()}


class CodecError(ValueError):
    """A tensor on the wire does not match its declared dtype, shape or place."""


def numpy_dtype(code: int) -> np.dtype:
    """The little-endian numpy dtype for a wire DataType."""
    try:
        return dtype_named(_NAMES[code]).newbyteorder("<")
    except KeyError:
        name = pb.DataType.Name(code) if code in pb.DataType.values() else str(code)
        supported = ", ".join(sorted(_WIRE_DTYPES))
        raise CodecError(f"unsupported dtype {name}; supported: {supported}") from None


def wire_dtype(dtype: np.dtype | str | type) -> pb.DataType:
    """The wire DataType for a numpy dtype."""
    return _wire_code(np.dtype(dtype))


@functools.lru_cache(maxsize=64)
def _wire_code(dtype: np.dtype) -> pb.DataType:
    """Cached: numpy makes a dtype's `name` afresh each time (4 us here, six per result
    header)."""
    try:
        return _WIRE_DTYPES[dtype.name]
    except KeyError:
        supported = ", ".join(sorted(_WIRE_DTYPES))
        raise CodecError(f"dtype {dtype.name} cannot travel; supported: {supported}") from None


def _little_endian(array: np.ndarray) -> np.ndarray:
    dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    return np.ascontiguousarray(array, dtype=dtype)


def _byte_view(array: np.ndarray) -> memoryview:
    """The bytes of a C-contiguous array (via uint8: the buffer protocol has no bfloat16)."""
    return array.reshape(-1).view(np.uint8).data


def encode_tensor(array: np.ndarray) -> pb.Tensor:
    """A whole array as one `Tensor` message, its bytes in it."""
    array = _little_endian(np.asarray(array))
    return pb.Tensor(dtype=wire_dtype(array.dtype), shape=array.shape, content=array.tobytes())


def announced_tensor(array: np.ndarray) -> pb.Tensor:
    """A `Tensor` of the array's dtype and shape marked `chunked`, its bytes held apart
    (`chunked_requests.Whole`: sent inline or in chunks straight from the array)."""
    return pb.Tensor(dtype=wire_dtype(array.dtype), shape=array.shape, chunked=True)


# No tensor pergrad handles comes near these; beyond them numpy cannot even describe one.
MAX_RANK = 32
MAX_ELEMENTS = 1 << 40


def checked_shape(shape: Sequence[int], *, what: str) -> tuple[int, ...]:
    """Shape as a tuple, refusing what no array can be before anything is allocated:
    negative dimensions, more than MAX_RANK of them, more than MAX_ELEMENTS elements
    (counting every dimension but zeros, so [0, 2^62, 2^62] is refused too)."""
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise CodecError(f"{what}: shape {list(shape)} has a negative dimension")
    if len(shape) > MAX_RANK:
        raise CodecError(f"{what}: shape of rank {len(shape)}; at most {MAX_RANK}")
    if math.prod(d for d in shape if d) > MAX_ELEMENTS:
        raise CodecError(f"{what}: shape {list(shape)} holds more than 2^40 elements")
    return shape


def declared_nbytes(dtype: np.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def decode_tensor(tensor: pb.Tensor, *, what: str) -> np.ndarray:
    """A read-only array viewing the message's bytes; `what` names the field in errors."""
    dtype = numpy_dtype(tensor.dtype)
    shape = checked_shape(tensor.shape, what=what)
    expected = declared_nbytes(dtype, shape)
    if expected != len(tensor.content):
        raise CodecError(
            f"{what}: {dtype.name} {list(shape)} needs {expected} bytes, got {len(tensor.content)}"
        )
    return np.frombuffer(tensor.content, dtype=dtype).reshape(shape)


def tensor_spec(name: str, array: np.ndarray) -> pb.TensorSpec:
    return pb.TensorSpec(name=name, dtype=wire_dtype(array.dtype), shape=array.shape)


def wire_bytes(array: np.ndarray) -> memoryview:
    """The array's bytes as they travel: little-endian, C order (a view where it can)."""
    return _byte_view(_little_endian(array))


def iter_raw_chunks(
    index: int, array: np.ndarray, *, start: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[RawChunk]:
    """(tensor index, byte offset, bytes) pieces of `array`, the first at byte `start`.

    `start` lets a slice of examples fill its place in the whole tensor: the rows of a
    C-contiguous [B, ...] tensor are contiguous byte ranges. The bytes are views, no copy.
    """
    data = wire_bytes(array)
    for offset in range(0, len(data), chunk_bytes):
        yield RawChunk(index, start + offset, data[offset : offset + chunk_bytes])


def iter_chunks(
    index: int, array: np.ndarray, *, start: int = 0, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[pb.TensorChunk]:
    """`iter_raw_chunks` as TensorChunk messages."""
    for tensor, offset, data in iter_raw_chunks(index, array, start=start, chunk_bytes=chunk_bytes):
        yield pb.TensorChunk(tensor=tensor, offset=offset, data=data.tobytes())


class TensorAssembler:
    """Fills tensors announced by specs from chunks that arrive, per tensor, in order.

    In-order, gap-free chunks make a truncated, duplicated or reordered stream an error
    rather than a silently wrong tensor.
    """

    def __init__(
        self, specs: Sequence[pb.TensorSpec], *, into: Sequence[np.ndarray] | None = None
    ) -> None:
        """`into`: arrays to fill instead of fresh ones (warm buffers fill faster); each
        must have its spec's dtype and shape and be C-contiguous and writeable. Check the
        specs against what you expect before: each tensor is allocated here."""
        if into is not None and len(into) != len(specs):
            raise CodecError(f"{len(into)} arrays to fill for {len(specs)} tensors")
        self._arrays: list[np.ndarray] = []
        self._bytes: list[memoryview] = []
        self._filled: list[int] = []
        self._names = [spec.name for spec in specs]
        for index, spec in enumerate(specs):
            dtype = numpy_dtype(spec.dtype)
            shape = checked_shape(spec.shape, what=f"tensor {spec.name!r}")
            array = np.empty(shape, dtype=dtype) if into is None else into[index]
            if (array.dtype, array.shape) != (dtype, shape) or not (
                array.flags.c_contiguous and array.flags.writeable
            ):
                raise CodecError(f"tensor {spec.name!r}: the array to fill does not fit it")
            self._arrays.append(array)
            self._bytes.append(_byte_view(array))
            self._filled.append(0)

    def add(self, chunk: pb.TensorChunk) -> None:
        self.add_raw(chunk.tensor, chunk.offset, chunk.data)

    def add_raw(self, tensor: int, offset: int, data: bytes | memoryview) -> None:
        """Copy `data` to bytes [offset, offset + len) of tensor number `tensor`."""
        if tensor >= len(self._arrays):
            raise CodecError(f"chunk for tensor {tensor}, but only {len(self._arrays)} declared")
        filled = self._filled[tensor]
        target = self._bytes[tensor]
        name = self._names[tensor]
        if offset != filled:
            raise CodecError(
                f"tensor {name!r}: chunk at byte {offset}, expected {filled} (out of order)"
            )
        end = filled + len(data)
        if end > len(target):
            raise CodecError(f"tensor {name!r}: chunk ends at byte {end}, past {len(target)}")
        target[filled:end] = data
        self._filled[tensor] = end

    def add_inline(self, data: bytes | memoryview) -> None:
        """Every tensor at once from a header's inline `data`: their bytes back to back."""
        offset = 0
        for index, target in enumerate(self._bytes):
            self.add_raw(index, 0, data[offset : offset + len(target)])
            offset += len(target)
        if offset != len(data):
            raise CodecError(f"inline result of {len(data)} bytes; its tensors hold {offset}")

    @property
    def complete(self) -> bool:
        return all(f == len(b) for f, b in zip(self._filled, self._bytes, strict=True))

    def arrays(self) -> list[np.ndarray]:
        """The filled tensors; an error names the first one still missing bytes."""
        for name, filled, target in zip(self._names, self._filled, self._bytes, strict=True):
            if filled != len(target):
                raise CodecError(f"tensor {name!r} truncated: {filled} of {len(target)} bytes")
        return self._arrays
