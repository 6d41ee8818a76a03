"""Reading a request sent in parts (gradient_service.proto, "Requests in parts"): its
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
from pergrad.wire.codec import CodecError
from pergrad.wire.request_parts import Parts


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
        parts = Parts(first)
        call.request_bytes += parts.nbytes
        if parts.nbytes and call.request_bytes > max_request_bytes:
            raise RequestTooLarge(
                f"a request of {call.request_bytes} bytes ({parts.nbytes} of them in chunks) "
                f"exceeds --max-request-bytes {max_request_bytes} "
                "(ModelInfo.limits.max_request_bytes); split the batch"
            )
        hold(call.request_bytes)
        while not parts.complete:
            message = next(rest, None)
            if message is None:
                break  # `whole` names the tensor left short
            if isinstance(message, RefusedRequest):
                raise message.error
            parts.add(message)
        return parts.whole()
    except CodecError as err:
        raise InvalidArgument(f"{type(first).__name__} in parts: {err}") from None
