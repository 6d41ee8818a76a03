"""Reading a request sent in chunks (gradient_service.proto, "Chunked requests"): its
size (its first message's bytes and its chunked tensors' declared bytes, kept on the
call's record) checked against --max-request-bytes and handed to `hold` before any
chunk is read, then its chunks read into place. The guard reads a one-request call's
this way, holding its bytes; the servicer each request of a stream."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from pergrad.server.admission import calls
from pergrad.server.admission.unparsed import over_max_batch
from pergrad.server.errors import Cancelled, InvalidArgument, PergradServerError, RequestTooLarge
from pergrad.server.status import RefusedRequest
from pergrad.wire.chunked_requests import Chunked
from pergrad.wire.codec import CodecError


def whole_request(
    first: Any,
    rest: Iterator[Any],
    *,
    call: calls.Call,
    max_request_bytes: int,
    max_batch: int,
    within_s: float = float("inf"),
    hold: Callable[[int], None] = lambda nbytes: None,
) -> Any:
    """The request `first` begins (its message's bytes on `call`'s record), its chunks
    read from `rest` (none for a request whose tensors are all inline, or a message of
    another kind), all within `within_s` of it; the record then carries the request's
    size, or, refused, the bytes received (what a refusal for content is charged).
    Raises InvalidArgument for a chunk out of place, RequestTooLarge for a request over
    the bound or declaring a batch over --max-batch (both from its first message),
    Cancelled for chunks too slow."""
    received = call.request_bytes
    try:
        chunked = Chunked(first)
        total = received + chunked.nbytes
        if chunked.nbytes and total > max_request_bytes:
            raise RequestTooLarge(
                f"a request of {total} bytes ({chunked.nbytes} of them in chunks) exceeds "
                f"--max-request-bytes {max_request_bytes} "
                "(ModelInfo.limits.max_request_bytes); split the batch"
            )
        over = [(what, batch) for what, batch in chunked.batches() if batch > max_batch]
        if over:
            raise over_max_batch(*over[0], max_batch)
        hold(total)
        began = time.monotonic()
        while not chunked.complete:
            message = next(rest, None)
            if message is None:
                break  # `whole` names the tensor left short
            if isinstance(message, RefusedRequest):
                raise message.error
            received += chunked.add(message)
            if time.monotonic() - began > within_s:
                raise Cancelled(
                    f"the request's chunks took over {within_s:g} s (--stall-timeout) after "
                    "its first message: send them at once"
                )
        call.request_bytes = total
        return chunked.whole()
    except CodecError as err:
        call.request_bytes = received
        raise InvalidArgument(f"{type(first).__name__} in chunks: {err}") from None
    except PergradServerError:
        call.request_bytes = received  # what a refusal for content is charged
        raise
