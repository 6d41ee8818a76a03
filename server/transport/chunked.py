"""Reading a request sent in chunks (gradient_service.proto, "Chunked requests"): its
size (its first message's bytes and its chunked tensors' declared bytes, kept on the
call's record) checked against --max-request-bytes and handed to `hold` before any
chunk is read, then its chunks read into place. The guard reads a one-request call's
this way, holding its bytes; the servicer each request of a stream."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from pergrad.server.admission import calls
from pergrad.server.errors import InvalidArgument, RequestTooLarge
from pergrad.server.status import RefusedRequest
from pergrad.wire.chunked_requests import Chunked
from pergrad.wire.codec import CodecError


def whole_request(
    first: Any,
    rest: Iterator[Any],
    *,
    call: calls.Call,
    max_request_bytes: int,
    hold: Callable[[int], None] = lambda nbytes: None,
) -> Any:
    """The request `first` begins (its message's bytes on `call`'s record), its chunks
    read from `rest` (none for a request whose tensors are all inline, or a message of
    another kind); the record then carries the request's size. Raises InvalidArgument
    for a part out of place, RequestTooLarge for a request over the bound."""
    try:
        chunked = Chunked(first)
        call.request_bytes += chunked.nbytes
        if chunked.nbytes and call.request_bytes > max_request_bytes:
            raise RequestTooLarge(
                f"a request of {call.request_bytes} bytes ({chunked.nbytes} of them in chunks) "
                f"exceeds --max-request-bytes {max_request_bytes} "
                "(ModelInfo.limits.max_request_bytes); split the batch"
            )
        hold(call.request_bytes)
        while not chunked.complete:
            message = next(rest, None)
            if message is None:
                break  # `whole` names the tensor left short
            if isinstance(message, RefusedRequest):
                raise message.error
            chunked.add(message)
        return chunked.whole()
    except CodecError as err:
        raise InvalidArgument(f"{type(first).__name__} in chunks: {err}") from None
