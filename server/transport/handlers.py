"""The four kinds of gRPC method handler, in one table: interceptors that wrap a handler,
and the service that registers its own, make one of the same kind through it.

A method taking one request may also be served as a request-streaming one (`replaced`
with `request_streaming`): the HTTP/2 wire is the same, so its clients cannot tell, and the
request is then read by the handler rather than by gRPC before any handler runs. The
kind its clients call it by is its descriptor's (`declared_kind`), for metrics labels."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import grpc

from pergrad.server.transport.grpc_private import pool_of, run_on
from pergrad.wire.rpc import streaming


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


def kind(request_streaming: bool, response_streaming: bool) -> Kind:
    return KINDS[request_streaming, response_streaming]


def kind_of(handler: grpc.RpcMethodHandler) -> Kind:
    """The kind gRPC serves `handler` as."""
    return kind(handler.request_streaming, handler.response_streaming)


def declared_kind(path: str, handler: grpc.RpcMethodHandler) -> Kind:
    """The kind of the method at `path` as its clients call it: its descriptor's
    (`wire.rpc.streaming`), else, for a method with none, `handler`'s."""
    declared = streaming(path)
    return kind_of(handler) if declared is None else kind(*declared)


def behavior_of(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    return getattr(handler, kind_of(handler).attribute)


def replaced(
    handler: grpc.RpcMethodHandler,
    behavior: Callable[..., Any],
    *,
    request_streaming: bool | None = None,
    request_deserializer: Callable[[bytes], Any] | None = None,
) -> grpc.RpcMethodHandler:
    """A handler running `behavior` with `handler`'s serializers (its request deserializer
    replaced where one is given) on the same thread pool, of `handler`'s kind unless
    `request_streaming` says otherwise (`behavior` then takes the iterator of requests)."""
    pool = pool_of(behavior_of(handler))
    if pool is not None and pool_of(behavior) is None:
        run_on(behavior, pool)
    streams = handler.request_streaming if request_streaming is None else request_streaming
    return kind(streams, handler.response_streaming).factory(
        behavior,
        request_deserializer=request_deserializer or handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


# Refusals (a missing token, a limit reached) end their call at once with an abort: they
# run on threads of their own, so a refused call never waits in the queue behind workers
# busy computing, holding a place there that an admitted call needs.
_REFUSALS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pergrad-refuse")


def refusal(response_streaming: bool, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler that ends the call with `code` at once, reading no request: served as
    request-streaming, so gRPC reads none first, on the refusals' threads."""

    def refuse(requests: Any, context: grpc.ServicerContext) -> None:
        context.abort(code, message)

    run_on(refuse, _REFUSALS)
    return kind(True, response_streaming).factory(refuse)
