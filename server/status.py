"""Where the servicer's errors become gRPC status codes: every servicer method is wrapped
by `status`. (Interceptors answer their own refusals: `auth` UNAUTHENTICATED and
PERMISSION_DENIED, `guard` RESOURCE_EXHAUSTED and CANCELLED for stalls; `health` ends
its Watch streams on stop.)

pergrad's own errors carry their code (`pergrad.server.errors`); malformed tensors and
options are INVALID_ARGUMENT; anything else is a bug, logged with its traceback and
answered INTERNAL without one.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from pergrad.server.admission import calls
from pergrad.server.errors import (
    InvalidArgument,
    NotFound,
    PergradServerError,
    RefusedUnparsed,
    RequestTooLarge,
)
from pergrad.server.metrics import ServerMetrics
from pergrad.server.transport.interceptors import ended_by_client
from pergrad.wire.casting import CastError
from pergrad.wire.catalogue import OptionError
from pergrad.wire.chunked_requests import Whole
from pergrad.wire.codec import CodecError

_LOGGER = logging.getLogger(__name__)
# Characters of an error message sent at most: messages quote what the client sent (a
# model's name, tensor names), and gRPC refuses trailers over 8 KiB, which the client
# would see as RESOURCE_EXHAUSTED instead of the error.
MAX_MESSAGE_CHARS = 1000


def bounded(message: str) -> str:
    """`message`, cut to MAX_MESSAGE_CHARS with a note of how much was left out."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    left_out = len(message) - MAX_MESSAGE_CHARS
    return f"{message[:MAX_MESSAGE_CHARS]}... ({left_out} more characters)"


@dataclass(frozen=True)
class RefusedRequest:
    """A request whose bytes are not a valid protobuf message of its type, or were
    refused before parsing (`parser`) or while its chunks were read (the guard): what its
    call answers; `model`, the model its first message names, where it was read (a
    refused update still counts for its model)."""

    error: PergradServerError
    model: str | None = None


# Refusals for what a request held, not for the server's state (a busy server's
# RESOURCE_EXHAUSTED, a pin's FAILED_PRECONDITION): marked on the call's record, so that
# its bytes count against its caller's budget (`guard`, a windowed `budgets.Budget`).
_CONTENT_ERRORS = (InvalidArgument, NotFound, RequestTooLarge, CodecError, OptionError, CastError)


# What refuses a request from its bytes, before it is parsed: the error, or None.
Refusal = Callable[[bytes], PergradServerError | None]


def parser(message_class: type[Message], refuse: Refusal | None = None) -> Callable[[bytes], Any]:
    """Deserializer that hands malformed bytes to the handler instead of failing in gRPC,
    which would answer INTERNAL; the handler answers INVALID_ARGUMENT. `refuse`, if
    given, looks at the bytes first: an error it gives refuses them unparsed."""

    def parse(data: bytes) -> Any:
        error = refuse(data) if refuse else None
        if error is not None:
            model = error.model if isinstance(error, RefusedUnparsed) else None
            return RefusedRequest(error, model=model)
        try:
            return message_class.FromString(data)
        except DecodeError as err:
            message = f"{message_class.__name__}: not a valid message: {err}"
            return RefusedRequest(InvalidArgument(message))

    return parse


def _abort(context: grpc.ServicerContext, err: Exception, metrics: ServerMetrics) -> None:
    if not context.is_active():
        # The client cancelled, its deadline passed, or a stall was cancelled: the call
        # ends as such, not as a server error (aborting marks it handled, so gRPC logs
        # nothing), and nobody is left to read the message.
        code = ended_by_client(context)
        _LOGGER.debug("call ended by its client (%s): %s", code.name, type(err).__name__)
        context.abort(code, "the call ended on the client's side")
    if isinstance(err, PergradServerError):
        code, message = grpc.StatusCode[err.code], str(err)
    elif isinstance(err, CodecError | OptionError | CastError):
        code, message = grpc.StatusCode.INVALID_ARGUMENT, str(err)
    else:
        _LOGGER.exception("internal error")
        code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}"
    if isinstance(err, _CONTENT_ERRORS):
        calls.of(context).refused_for_content = True
    metrics.request_rejected(code)
    context.abort(code, bounded(message))


def _well_formed(request: Any) -> Any:
    """The request, or each request of a stream, refused if its bytes did not parse."""
    if isinstance(request, RefusedRequest):
        raise request.error
    if isinstance(request, Message | Whole):
        return request
    return (_well_formed(item) for item in request)


def status(method: Callable[..., Any]) -> Callable[..., Any]:
    """Map pergrad, codec and option errors to their status codes, anything else to INTERNAL."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def streaming(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from method(self, _well_formed(request), context)
            except Exception as err:
                _abort(context, err, self.metrics)

        return streaming

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, _well_formed(request), context)
        except Exception as err:
            _abort(context, err, self.metrics)

    return unary
