"""gRPC server interceptor that counts and times every RPC (go-grpc-prometheus metrics).

The final status code is the one the client sees: the code `context.abort` or
`context.set_code` set, UNKNOWN for any other exception (also mid-stream), CANCELLED or
DEADLINE_EXCEEDED for a call that ended on the client's side, OK otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from pergrad.server.metrics import RpcLabels, ServerMetrics
from pergrad.server.transport.grpc_private import (
    cancelled_by_client,
    code_set,
    is_non_blocking,
    non_blocking,
)
from pergrad.server.transport.handlers import behavior_of, declared_kind, replaced
from pergrad.wire.rpc import split_method

# The client cancels at its own deadline, which the server's copy of it trails by the time
# the call took to arrive; a call ended that close to its deadline ended by it.
DEADLINE_SLACK_S = 1.0


def ended_by_client(context: grpc.ServicerContext) -> grpc.StatusCode:
    """DEADLINE_EXCEEDED for a call ended (by its client's side) at its deadline, else
    CANCELLED."""
    remaining = context.time_remaining()
    if remaining is not None and remaining <= DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


def final_code(
    context: grpc.ServicerContext, error: BaseException | None, *, ended: bool = False
) -> grpc.StatusCode:
    """The status a call ends with, given the exception its handler raised (or None);
    `ended`: asked once the call has ended (so it is no longer active either way)."""
    if ended and cancelled_by_client(context):
        return ended_by_client(context)
    code = code_set(context)
    if isinstance(code, grpc.StatusCode):
        return code
    if error is not None and not isinstance(error, GeneratorExit):
        return grpc.StatusCode.UNKNOWN
    if isinstance(error, GeneratorExit) or (not ended and not context.is_active()):
        return ended_by_client(context)
    return grpc.StatusCode.OK


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts started and handled RPCs and messages, and times each RPC, into `metrics`."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        # Runs on gRPC's polling thread as the call arrives, before a worker picks it up.
        arrived = time.perf_counter()
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        service, method = split_method(handler_call_details.method)
        declared = declared_kind(handler_call_details.method, handler)
        labels = RpcLabels(declared.grpc_type, service or "unknown", method)
        at_end = declared.grpc_type in ("client_stream", "bidi_stream")
        call = _Call(self._metrics, labels, arrived, at_end)
        behavior = behavior_of(handler)
        if is_non_blocking(behavior):
            behavior = call.wrap_non_blocking(behavior)
        else:
            behavior = call.wrap(behavior, handler.request_streaming, handler.response_streaming)
        return replaced(handler, behavior)


@dataclass
class _Call:
    """The metrics of one RPC: started when its handler runs, handled exactly once. A
    request stream's (`at_end`) is counted when the call has ended, not when its
    handler returns: only then is a cancelled stream told from a finished one."""

    _metrics: ServerMetrics
    _labels: RpcLabels
    _arrived: float
    _at_end: bool
    _handled: bool = False
    _error: BaseException | None = None

    def wrap(
        self, behavior: Callable[..., Any], request_streaming: bool, response_streaming: bool
    ) -> Callable[..., Any]:
        def handle(request: Any, context: grpc.ServicerContext) -> Any:
            self._metrics.rpc_started(self._labels, self._arrived)
            if self._at_end and not context.add_callback(lambda: self._ended(context)):
                self._ended(context)
            if request_streaming:
                request = self._received(request)
            else:
                self._metrics.rpc_message_received(self._labels)
            try:
                result = behavior(request, context)
            except BaseException as err:
                self._finish(context, err)
                raise
            if response_streaming:
                return self._sent(result, context)
            self._metrics.rpc_message_sent(self._labels)
            self._finish(context, None)
            return result

        return handle

    def wrap_non_blocking(self, behavior: Callable[..., Any]) -> Callable[..., Any]:
        """The same for a handler that answers through a `send` callback and returns at
        once (health Watch), keeping the flag so that it holds no worker thread."""

        def handle(request: Any, context: grpc.ServicerContext, send: Callable[[Any], None]):
            self._metrics.rpc_started(self._labels, self._arrived)
            self._metrics.rpc_message_received(self._labels)
            if not context.add_callback(lambda: self._finish(context, None)):
                self._finish(context, None)  # the call ended before its handler ran

            def counted(response: Any) -> None:
                if response is None:
                    self._finish(context, None)
                else:
                    self._metrics.rpc_message_sent(self._labels)
                send(response)

            try:
                return behavior(request, context, counted)
            except BaseException as err:
                self._finish(context, err)
                raise

        non_blocking(handle)  # its pool carried over by `replaced`
        return handle

    def _received(self, requests: Iterator[Any]) -> Iterator[Any]:
        for request in requests:
            self._metrics.rpc_message_received(self._labels)
            yield request

    def _sent(self, responses: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        responses = iter(responses)
        try:
            for response in responses:
                self._metrics.rpc_message_sent(self._labels)
                yield response
        except BaseException as err:
            self._finish(context, err)
            close = getattr(responses, "close", None)
            if isinstance(err, GeneratorExit) and close is not None:
                close()
            raise
        self._finish(context, None)

    def _finish(self, context: grpc.ServicerContext, error: BaseException | None) -> None:
        if self._at_end:
            self._error = self._error or error  # counted by `_ended`
        else:
            self._handle(final_code(context, error))

    def _ended(self, context: grpc.ServicerContext) -> None:
        self._handle(final_code(context, self._error, ended=True))

    def _handle(self, code: grpc.StatusCode) -> None:
        if not self._handled:
            self._handled = True
            self._metrics.rpc_handled(self._labels, code, self._arrived)
