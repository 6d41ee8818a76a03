"""The four kinds of gRPC method handler, in one table: interceptors that wrap a handler,
and the service that registers its own, make one of the same kind through it.

A method taking one request may also be served as a request-streaming one
(`as_request_stream`): the HTTP/2 wire is the same, so its clients cannot tell, and the
request is then read by the handler rather than by gRPC before any handler runs. Such a
handler keeps the method's own kind (`declared_kind_of`) for metrics labels."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc

from pergrad.server.transport.grpc_private import pool_of, run_on


class Kind(NamedTuple):
    grpc_type: str  # the go-grpc-prometheus label
    attribute: str  # the RpcMethodHandler attribute holding the behaviour
    factory: Callable[..., grpc.RpcMethodHandler]


KINDS: dict[tuple[bool, bool], Kind] = {
    (False, False): Kind("unary", "unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): Kind("server_stream", "unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): Kind("client_stream", "stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): Kind("bidi_stream", "stream_stream", grpc.stream_stream_rpc_method_handler),
}


@dataclass(frozen=True)
class _Redeclared(grpc.RpcMethodHandler):
    """A handler served as the kind its fields say, for a method of kind `declared`."""

    request_streaming: bool
    response_streaming: bool
    request_deserializer: Callable[[bytes], Any] | None
    response_serializer: Callable[[Any], bytes] | None
    unary_unary: Callable[..., Any] | None
    unary_stream: Callable[..., Any] | None
    stream_unary: Callable[..., Any] | None
    stream_stream: Callable[..., Any] | None
    declared: Kind


_STREAMING = {k: streaming for streaming, k in KINDS.items()}


def kind(request_streaming: bool, response_streaming: bool) -> Kind:
    return KINDS[request_streaming, response_streaming]


def kind_of(handler: grpc.RpcMethodHandler) -> Kind:
    """The kind gRPC serves `handler` as."""
    return kind(handler.request_streaming, handler.response_streaming)


def declared_kind_of(handler: grpc.RpcMethodHandler) -> Kind:
    """The kind of the method `handler` serves, as its clients call it."""
    return handler.declared if isinstance(handler, _Redeclared) else kind_of(handler)


def behavior_of(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    return getattr(handler, kind_of(handler).attribute)


def replaced(
    handler: grpc.RpcMethodHandler,
    behavior: Callable[..., Any],
    *,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind (and declared kind) running `behavior`, with its
    serializers (its request deserializer replaced where one is given), on the same
    thread pool."""
    deserializer = request_deserializer or handler.request_deserializer
    return _made(handler, kind_of(handler), behavior, deserializer)


def as_request_stream(
    handler: grpc.RpcMethodHandler,
    behavior: Callable[..., Any],
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """`handler`'s method served as request-streaming, with its response arity, serializers
    (or `request_deserializer`), thread pool and declared kind: `behavior` takes the
    iterator of requests in place of the one request."""
    deserializer = request_deserializer or handler.request_deserializer
    return _made(handler, kind(True, handler.response_streaming), behavior, deserializer)


# Refusals (a missing token, a limit reached) end their call at once with an abort: they
# run on threads of their own, so a refused call never waits in the queue behind workers
# busy computing, holding a place there that an admitted call needs.
_REFUSALS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pergrad-refuse")


def refusal(declared: Kind, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """A handler for a method of kind `declared` whose `behavior` ends the call at once
    (aborts), reading no request: served as request-streaming, so gRPC reads none first,
    on the refusals' threads."""
    run_on(behavior, _REFUSALS)
    response_streaming = _STREAMING[declared][1]
    return _declared_as(kind(True, response_streaming).factory(behavior), declared)


def _made(
    handler: grpc.RpcMethodHandler,
    served_as: Kind,
    behavior: Callable[..., Any],
    request_deserializer: Callable[[bytes], Any] | None,
) -> grpc.RpcMethodHandler:
    pool = pool_of(behavior_of(handler))
    if pool is not None and pool_of(behavior) is None:
        run_on(behavior, pool)
    made = served_as.factory(
        behavior,
        request_deserializer=request_deserializer,
        response_serializer=handler.response_serializer,
    )
    return _declared_as(made, declared_kind_of(handler))


def _declared_as(made: grpc.RpcMethodHandler, declared: Kind) -> grpc.RpcMethodHandler:
    if declared == kind_of(made):
        return made
    return _Redeclared(
        made.request_streaming,
        made.response_streaming,
        made.request_deserializer,
        made.response_serializer,
        made.unary_unary,
        made.unary_stream,
        made.stream_unary,
        made.stream_stream,
        declared,
    )
