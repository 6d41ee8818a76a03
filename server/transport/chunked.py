"""Reading a request sent in chunks (gradient_service.proto, "Chunked requests"): its
size (its first message's bytes and its chunked tensors' declared bytes, kept on the
call's record) checked against --max-request-bytes and handed to `hold` before any
chunk is read, then its chunks read into place. The guard reads a one-request call's
this way, holding its bytes; the servicer each request of a stream."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pergrad.server.admission import calls
from pergrad.server.errors import (
    Cancelled,
    InvalidArgument,
    PergradServerError,
    RequestTooLarge,
    over_max_batch,
)
from pergrad.server.status import RefusedRequest
from pergrad.wire.chunked_requests import Chunked, Whole
from pergrad.wire.codec import CodecError


@dataclass(frozen=True)
class RequestBounds:
    """What a request in chunks is held to from its first message: its bytes, its batch,
    and the seconds its chunks may take (the stall timeout)."""

    max_request_bytes: int
    max_batch: int
    within_s: float


def whole_request(
    first: Any,
    rest: Iterator[Any],
    *,
    call: calls.Call,
    bounds: RequestBounds,
    hold: Callable[[int], None] = lambda nbytes: None,
) -> Whole:
    """The request `first` begins (its message's bytes on `call`'s record), its chunks
    read from `rest` into arrays (none for a request whose tensors are all inline, or a
    message of another kind); the record then carries the bytes of every message read, the
    request's size when it is whole (what a refusal for content is charged). Raises
    InvalidArgument for a chunk out of place, RequestTooLarge for a request over a bound
    (from its first message), Cancelled for chunks too slow."""
    received = call.request_bytes
    try:
        chunked = _within_bounds(Chunked(first), received, bounds)
        hold(received + chunked.nbytes)
        began = time.monotonic()
        while not chunked.complete and (message := _next(rest)) is not None:
            received += call.request_bytes  # as read (its deserializer's record)
            if isinstance(message, RefusedRequest):
                raise message.error
            chunked.add(message, call.request_bytes)
            if time.monotonic() - began > bounds.within_s:
                raise Cancelled(
                    f"the request's chunks took over {bounds.within_s:g} s (--stall-timeout) "
                    "after its first message: send them at once"
                )
        return chunked.whole()  # names the tensor left short, if the stream ended early
    except CodecError as err:
        raise InvalidArgument(f"{type(first).__name__} in chunks: {err}") from None
    finally:
        call.request_bytes = received


def _next(rest: Iterator[Any]) -> Any:
    """The next message, or None; one that did not parse a RefusedRequest, however the
    iterator gives it (a stream's servicer raises it), so that its bytes are charged."""
    try:
        return next(rest, None)
    except PergradServerError as err:
        return RefusedRequest(err)


def _within_bounds(chunked: Chunked, first_bytes: int, bounds: RequestBounds) -> Chunked:
    """`chunked`, refused if what its first message declares passes a bound."""
    total = first_bytes + chunked.nbytes
    if chunked.nbytes and total > bounds.max_request_bytes:
        raise RequestTooLarge(
            f"a request of {total} bytes ({chunked.nbytes} of them in chunks) exceeds "
            f"--max-request-bytes {bounds.max_request_bytes} "
            "(ModelInfo.limits.max_request_bytes); split the batch"
        )
    over = [(what, batch) for what, batch in chunked.batches() if batch > bounds.max_batch]
    if over:
        raise over_max_batch(*over[0], bounds.max_batch)
    return chunked
