"""Chunked requests (gradient_service.proto): a GradientsRequest or StepRequest whose
large tensors are marked `chunked` and follow it as messages holding only a chunk. The
one place that numbers a request's chunked tensors: for the client that splits a request
(`in_chunks`) and the server that assembles it (`Chunked`, giving a `Whole`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.message import Message

from pergrad.v1 import gradient_service_pb2 as pb
from pergrad.v1 import tensor_pb2
from pergrad.wire.chunks import encode_chunk_in
from pergrad.wire.codec import (
    DEFAULT_CHUNK_BYTES,
    CodecError,
    TensorAssembler,
    checked_shape,
    declared_nbytes,
    decode_tensor,
    encode_tensor,
    numpy_dtype,
    wire_bytes,
)
from pergrad.wire.text import quoted

# The most a server takes in one message, whatever the models it serves (gRPC's default).
MESSAGE_BYTES = 4 << 20
# What a client keeps inline at most: its largest tensors are chunked until the rest fit,
# leaving a MiB of MESSAGE_BYTES for the request's other fields. One message costs less
# than chunks (a request of 1.15 MiB: 4.2 ms in one, 5.3 in three messages, split included).
INLINE_BYTES = 3 << 20
# Each chunk of a request but a tensor's last holds at least this: a client cannot make
# the server hold a request's declared bytes while it trickles them a byte at a time.
MIN_CHUNK_BYTES = 64 << 10
# A chunk message's bytes besides its data at most: its chunk's tensor and offset, and
# the tags and lengths (34 bytes in any encoding that sends each field once).
CHUNK_FIELDS_BYTES = 64
# The fields of a request whose tensors hold examples (their first dimension the batch).
_EXAMPLES = ("inputs", "named_inputs", "labels")
# The requests that may come in chunks; any other message is always whole.
_IN_PARTS = (pb.GradientsRequest, pb.StepRequest)
Request = pb.GradientsRequest | pb.StepRequest
_CHUNK_FIELD = {
    pb.GradientsRequest: pb.GradientsRequest.CHUNK_FIELD_NUMBER,
    pb.StepRequest: pb.StepRequest.CHUNK_FIELD_NUMBER,
}


# A request's tensor: its field (a StepRequest's batch's as "batch.<field>") and its key
# in that map (None for a field that is no map), whole: what arrays are kept by. Errors
# name it as `tensor_name` does, a long key cut short.
Key = tuple[str, str | None]


def _by_key(field: str, tensors: Mapping[str, tensor_pb2.Tensor]) -> list[tuple[Key, Any]]:
    """A map's tensors in ascending byte order of their keys."""
    return [((field, key), tensors[key]) for key in sorted(tensors, key=str.encode)]


def tensor_keys(message: Message) -> list[tuple[Key, tensor_pb2.Tensor]]:
    """Every tensor of a GradientsRequest or StepRequest by its key, in the order that
    numbers the chunked ones; none for any other message."""
    if isinstance(message, pb.StepRequest):
        batch = tensor_keys(message.batch) if message.HasField("batch") else []
        keyed = [((f"batch.{field}", key), tensor) for (field, key), tensor in batch]
        return keyed + _by_key("gradient_sum", message.gradient_sum)
    if not isinstance(message, pb.GradientsRequest):
        return []  # a message of another kind is always whole
    tensors: list[tuple[Key, Any]] = []
    tensors += [(("inputs", None), message.inputs)] if message.HasField("inputs") else []
    tensors += _by_key("named_inputs", message.named_inputs)
    tensors += [(("labels", None), message.labels)] if message.HasField("labels") else []
    return tensors + _by_key("reference", message.reference)


def tensor_name(key: Key) -> str:
    """A tensor as errors name it: `inputs`, `reference['w']`."""
    field, name = key
    return field if name is None else f"{field}[{quoted(name)}]"


def _nbytes(what: str, tensor: tensor_pb2.Tensor) -> int:
    """The bytes a tensor's dtype and shape declare (refused where no array could hold
    them, before anything is allocated)."""
    dtype = numpy_dtype(tensor.dtype)
    return declared_nbytes(dtype, checked_shape(tensor.shape, what=what))


def _moved(sizes: list[int], inline_bytes: int) -> list[int]:
    """The positions of the largest sizes taken out until the rest hold `inline_bytes` at
    most, in ascending order (the proto's numbering of the chunked tensors)."""
    inline, moved = sum(sizes), []
    for size, position in sorted(((s, i) for i, s in enumerate(sizes)), reverse=True):
        if inline <= inline_bytes:
            break
        moved.append(position)
        inline -= size
    return sorted(moved)


def in_chunks(
    request: Request | Whole,
    *,
    inline_bytes: int = INLINE_BYTES,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> list[Request | bytes]:
    """The request as it travels: [message] where its tensors hold `inline_bytes` at most,
    else a header with its largest tensors marked `chunked` until the others do, then
    their bytes as serialized chunk messages. A `Whole`'s arrays go as they are, never
    copied into its message first: inline into the header, or as chunks viewing them
    (the request itself unchanged: a retry sends it again)."""
    whole = Whole.of(request)
    keyed = tensor_keys(whole.message)
    arrays = whole.arrays_of(keyed)
    sizes = [
        _nbytes(tensor_name(key), tensor) if array is None else array.nbytes
        for (key, tensor), array in zip(keyed, arrays, strict=True)
    ]
    moved = _moved(sizes, inline_bytes)
    if not moved and not whole.arrays:
        return [whole.message]
    # The header: small, unless a tensor held inline is moved. An array kept inline goes
    # in as a Tensor of its own: its bytes set in place, the header then took 2.0 ms to
    # serialize at 0.8 MiB here, against 0.2.
    header = copy.deepcopy(whole.message)
    tensors = [tensor for _, tensor in tensor_keys(header)]
    for position, (tensor, array) in enumerate(zip(tensors, arrays, strict=True)):
        if array is not None and position not in moved:
            tensor.CopyFrom(encode_tensor(array))
    field = _CHUNK_FIELD[type(header)]
    chunks: list[Request | bytes] = []
    for index, position in enumerate(moved):
        tensor, array = tensors[position], arrays[position]
        view = memoryview(tensor.content) if array is None else wire_bytes(array)
        tensor.content, tensor.chunked = b"", True
        chunks += [
            encode_chunk_in(field, index, offset, view[offset : offset + chunk_bytes])
            for offset in range(0, len(view), chunk_bytes)
        ]
    return [header, *chunks]


@dataclass(frozen=True)
class Whole:
    """A request and the arrays of the tensors its message announces (dtype, shape, marked
    `chunked`) without their bytes, by key (`tensor_keys`): as the client builds it
    (`in_chunks` sends the arrays), and as the server reads it (the arrays its chunks
    were assembled into). Those bytes never pass through the message: setting a bytes
    field and reading it back copies them twice, into fresh pages each time (a 25 MiB
    request: ~35 ms here)."""

    message: Any  # a GradientsRequest or StepRequest; any other message, whole
    arrays: Mapping[Key, np.ndarray] = field(default_factory=dict)

    @classmethod
    def of(cls, request: Any) -> Whole:
        """`request` itself if a `Whole`, else the message with no arrays beside it."""
        return request if isinstance(request, Whole) else cls(request)

    @property
    def model(self) -> str:
        return getattr(self.message, "model", "")

    def array(self, tensor: tensor_pb2.Tensor, key: Key) -> np.ndarray:
        """The request's tensor `key`: its array if the message announces it without its
        bytes (chunked), else a read-only view of its bytes."""
        if not tensor.chunked:
            return decode_tensor(tensor, what=tensor_name(key))
        if key not in self.arrays:
            raise CodecError(f"{tensor_name(key)}: marked chunked, yet no chunks were read for it")
        return self.arrays[key]

    def arrays_of(self, keyed: list[tuple[Key, tensor_pb2.Tensor]]) -> list[np.ndarray | None]:
        """The array of each of the message's tensors (`tensor_keys`), None for one whose
        bytes the message holds; ValueError for an array of no tensor, or a tensor
        announced without its array."""
        unknown = set(self.arrays) - {key for key, _ in keyed}
        missing = [k for k, t in keyed if t.chunked and k not in self.arrays]
        if unknown or missing:
            names = sorted(tensor_name(key) for key in [*unknown, *missing])
            raise ValueError(f"arrays and announced tensors differ at {names}")
        return [self.arrays.get(key) for key, _ in keyed]

    def inline(self) -> Any:
        """The request as one message, every array's bytes in place."""
        message = copy.deepcopy(self.message)
        keyed = tensor_keys(message)
        for (_, tensor), array in zip(keyed, self.arrays_of(keyed), strict=True):
            if array is not None:
                tensor.CopyFrom(encode_tensor(array))
        return message

    def within(self, outer: Any, name: str) -> Whole:
        """`outer` (a StepRequest) holding this request in its field `name`, with its
        arrays (the inverse of `part`)."""
        getattr(outer, name).CopyFrom(self.message)
        arrays = {(f"{name}.{field}", key): array for (field, key), array in self.arrays.items()}
        return Whole(outer, arrays)

    def part(self, name: str) -> Whole:
        """The request its field `name` holds (a StepRequest's batch), with its arrays."""
        prefix = f"{name}."
        arrays = {
            (field.removeprefix(prefix), key): array
            for (field, key), array in self.arrays.items()
            if field.startswith(prefix)
        }
        return Whole(getattr(self.message, name), arrays)


def comes_in_parts(message: Any) -> bool:
    """Whether `message` is a request that may come in chunks (else always whole)."""
    return isinstance(message, _IN_PARTS)


def is_chunk(message: Any) -> bool:
    """Whether `message` carries a chunk of the request before it."""
    return isinstance(message, _IN_PARTS) and message.HasField("chunk")


class Chunked:
    """A request's chunked tensors (`nbytes` of them, as declared), filled from the chunk
    messages that follow it (`add`) until `complete`; `whole` then gives the request."""

    def __init__(self, message: Message) -> None:
        batch = message.batch if isinstance(message, pb.StepRequest) else None
        if is_chunk(message) or (batch is not None and batch.HasField("chunk")):
            raise CodecError(f"{type(message).__name__}: a chunk where a request was due")
        self._message = message
        self._chunked = [(k, tensor_name(k), t) for k, t in tensor_keys(message) if t.chunked]
        for _, what, tensor in self._chunked:
            if tensor.content:
                raise CodecError(f"{what}: chunked, yet holds {len(tensor.content)} bytes")
        self._sizes = [_nbytes(what, tensor) for _, what, tensor in self._chunked]
        self.nbytes = sum(self._sizes)
        self._assembler: TensorAssembler | None = None

    def batches(self) -> list[tuple[str, int]]:
        """The batch each chunked tensor of examples declares (inputs and labels; not a
        `dot`'s references nor a step's gradient sum)."""
        return [
            (what, int(tensor.shape[0]))
            for (field, _), what, tensor in self._chunked
            if tensor.shape and field.removeprefix("batch.") in _EXAMPLES
        ]

    @property
    def complete(self) -> bool:
        return self._assembly().complete if self._chunked else True

    def add(self, message: Request, nbytes: int = 0) -> None:
        """One chunk message (`nbytes` on the wire, where known): only its chunk set,
        for a tensor still missing bytes, of MIN_CHUNK_BYTES at least unless it ends its
        tensor."""
        if not message.HasField("chunk") or len(message.ListFields()) != 1:
            raise CodecError(
                f"{type(message).__name__}: a message holding only `chunk` was due (the "
                f"request before it declares {self.nbytes} bytes in chunks)"
            )
        chunk = message.chunk
        data = chunk.data
        if nbytes - len(data) > CHUNK_FIELDS_BYTES:
            raise CodecError(
                f"a chunk message of {nbytes} bytes holds {len(data)} of data: it may hold "
                f"{CHUNK_FIELDS_BYTES} more at most (fields this server does not know)"
            )
        self._assembly().add_raw(chunk.tensor, chunk.offset, data)
        if len(data) < MIN_CHUNK_BYTES and chunk.offset + len(data) < self._sizes[chunk.tensor]:
            raise CodecError(
                f"a chunk of {len(data)} bytes: each chunk but a tensor's last holds "
                f"{MIN_CHUNK_BYTES} at least"
            )

    def whole(self) -> Whole:
        """The request and its chunked tensors' arrays (refused if any is short)."""
        if not self._chunked:
            return Whole(self._message)
        arrays = self._assembly().arrays()
        for array in arrays:
            array.flags.writeable = False  # as read-only as a view of a message's bytes
        keys = [key for key, _, _ in self._chunked]
        return Whole(self._message, dict(zip(keys, arrays, strict=True)))

    def _assembly(self) -> TensorAssembler:
        """Allocated when first needed: after the caller checked and priced `nbytes`."""
        if self._assembler is None:
            specs = [
                tensor_pb2.TensorSpec(name=what, dtype=t.dtype, shape=t.shape)
                for _, what, t in self._chunked
            ]
            self._assembler = TensorAssembler(specs)
        return self._assembler
