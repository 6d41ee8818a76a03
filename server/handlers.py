"""The four kinds of gRPC method handler, in one table: interceptors that wrap a handler,
and the service that registers its own, make one of the same kind through it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import grpc


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
    return kind(handler.request_streaming, handler.response_streaming)


def behavior_of(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    return getattr(handler, kind_of(handler).attribute)


def replaced(
    handler: grpc.RpcMethodHandler,
    behavior: Callable[..., Any],
    *,
    request_deserializer: Callable[[bytes], Any] | bool | None = True,
) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind running `behavior`, with its serializers (or no
    request deserializer with `request_deserializer=None`), on the same thread pool."""
    pool = getattr(behavior_of(handler), "experimental_thread_pool", None)
    if pool is not None and getattr(behavior, "experimental_thread_pool", None) is None:
        behavior.experimental_thread_pool = pool
    deserializer = (
        handler.request_deserializer if request_deserializer is True else request_deserializer
    )
    return kind_of(handler).factory(
        behavior,
        request_deserializer=deserializer,
        response_serializer=handler.response_serializer,
    )
