"""Keeping idle and slow callers from holding the server's capacity.

A sync gRPC server runs each call in a worker thread; a call that waits on its client
(a request that never comes, a stream that sends no next request, a client that reads no
response) holds its worker for as long as the client likes. This interceptor:
- cancels a call that has waited on its client for `stall_timeout_s` (time the handler
  spends computing does not count: only waiting for a request, or for gRPC to send a
  response, which the client's reading paces);
- serves every method that takes one request as request-streaming (the same on the
  wire, `handlers.as_request_stream`) and reads that request itself, so that waiting for
  it is timed too (gRPC would read it before any handler runs, for as long as it takes);
  a call that ends with no request, or sends a second, is INVALID_ARGUMENT;
- admits at most `max_streams` request-streaming calls at once (StreamPerExampleGradients,
  SetWeights), and at most `max_open_streams` of the open services' (reflection);
- runs every call to an open service (health, reflection) on a pool of its own, with
  PROBE_THREADS beyond its streams' for health: a caller without a token cannot reach
  the workers;
- lets non-blocking handlers (health Watch) return as soon as their request is read:
  they then hold no thread; at most `max_watch_streams` are open at once (each counts
  toward gRPC's `maximum_concurrent_rpcs`, which the server raises by that many).
Beyond a limit a call is refused at once with RESOURCE_EXHAUSTED. The number of calls
waiting for a worker is bounded by gRPC itself (`maximum_concurrent_rpcs`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from pergrad.server.handlers import (
    as_request_stream,
    behavior_of,
    declared_kind_of,
    refusal,
    replaced,
)
from pergrad.server.interceptors import ended_by_client
from pergrad.wire.rpc import OPEN_SERVICES, split_method

_LOGGER = logging.getLogger(__name__)
_NOTHING = object()
_STALLED = "{method}: cancelled, its client sent nothing for the stall timeout"
# Threads of the open services' pool beyond `max_open_streams`: health checks, and Watch
# requests, are answered while reflection streams are open.
PROBE_THREADS = 2


class _Waits:
    """Calls waiting on their clients, and a thread that cancels those waiting too long."""

    def __init__(self, timeout_s: float, on_stall: Callable[[str], None]) -> None:
        self._timeout_s = timeout_s
        self._on_stall = on_stall
        self._waiting: dict[int, tuple[float, grpc.ServicerContext, str]] = {}
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="pergrad-stalls", daemon=True).start()

    def start(self, context: grpc.ServicerContext, method: str) -> int:
        token = next(self._tokens)
        with self._lock:
            self._waiting[token] = (time.monotonic(), context, method)
        return token

    def end(self, token: int) -> bool:
        """Stop timing; False if the call was cancelled as stalled meanwhile."""
        with self._lock:
            return self._waiting.pop(token, None) is not None

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(min(1.0, self._timeout_s / 4)):
            now = time.monotonic()
            with self._lock:
                stalled = [
                    (token, context, method)
                    for token, (since, context, method) in self._waiting.items()
                    if now - since > self._timeout_s
                ]
                for token, _, _ in stalled:
                    del self._waiting[token]
            for _, context, method in stalled:
                _LOGGER.info("cancelled %s: its client stalled for %.0f s", method, self._timeout_s)
                self._on_stall(method)
                context.cancel()


class _Slots:
    """Streams admitted at once: running ones, and ones admitted whose handler has not
    started yet (reservations, forgotten after RESERVATION_S in case gRPC refused the call
    itself after this interceptor ran)."""

    RESERVATION_S = 10.0

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._running = 0
        self._reserved: deque[float] = deque()
        self._lock = threading.Lock()

    def reserve(self) -> bool:
        now = time.monotonic()
        with self._lock:
            while self._reserved and now - self._reserved[0] > self.RESERVATION_S:
                self._reserved.popleft()
            if self._running + len(self._reserved) >= self.limit:
                return False
            self._reserved.append(now)
            return True

    def start(self) -> None:
        with self._lock:
            if self._reserved:
                self._reserved.popleft()
            self._running += 1

    def end(self) -> None:
        with self._lock:
            self._running -= 1

    def start_until_done(self, context: grpc.ServicerContext) -> None:
        """Start, and end when the call ends."""
        self.start()
        if not context.add_callback(self.end):  # it has ended already
            self.end()


class CallGuard(grpc.ServerInterceptor):
    def __init__(
        self,
        *,
        stall_timeout_s: float,
        max_streams: int,
        max_open_streams: int,
        max_watch_streams: int,
        on_stall: Callable[[str], None] = lambda method: None,
    ) -> None:
        self._waits = _Waits(stall_timeout_s, on_stall)
        self._slots = {False: _Slots(max_streams), True: _Slots(max_open_streams)}
        self._watches = _Slots(max_watch_streams)
        self._open_pool = ThreadPoolExecutor(
            max_workers=max_open_streams + PROBE_THREADS,
            thread_name_prefix="pergrad-open",
        )

    def close(self) -> None:
        self._waits.stop()
        self._open_pool.shutdown(wait=False, cancel_futures=True)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        """Runs on gRPC's polling thread as the call arrives: a stream over its limit is
        refused here, by a handler that takes a worker for an instant, never the slot."""
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        open_service = split_method(method)[0] in OPEN_SERVICES
        behavior = behavior_of(handler)
        if not handler.request_streaming:
            watch = getattr(behavior, "experimental_non_blocking", False)
            if watch and not self._watches.reserve():
                return refusal(declared_kind_of(handler), _refuse(self._watches.limit))
            guarded = self._one_request(
                behavior, method, handler.response_streaming, self._watches if watch else None
            )
        elif getattr(behavior, "experimental_non_blocking", False):
            return handler
        else:
            slots = self._slots[open_service]
            if not slots.reserve():
                return refusal(declared_kind_of(handler), _refuse(slots.limit))
            guarded = self._stream(behavior, method, handler.response_streaming, slots)
        if open_service:
            guarded.experimental_thread_pool = self._open_pool
        if handler.request_streaming:
            return replaced(handler, guarded)
        return as_request_stream(handler, guarded)

    def _requests(
        self, iterator: Iterator[Any], context: grpc.ServicerContext, method: str
    ) -> Iterator[Any]:
        """The requests, each waited for under the stall timer. A call cancelled as stalled
        ends CANCELLED, whichever way gRPC ends its request stream (it may end it normally,
        which the handler would take for the client's end)."""
        while True:
            token = self._waits.start(context, method)
            try:
                item = next(iterator, _NOTHING)
            finally:
                if not self._waits.end(token):
                    context.abort(grpc.StatusCode.CANCELLED, _STALLED.format(method=method))
            if item is _NOTHING:
                return
            yield item

    def _responses(
        self, iterator: Iterator[Any], context: grpc.ServicerContext, method: str
    ) -> Iterator[Any]:
        for item in iterator:
            token = self._waits.start(context, method)  # until gRPC has sent it and asks again
            try:
                yield item
            finally:
                self._waits.end(token)

    def _request(self, iterator: Iterator[Any], context: grpc.ServicerContext, method: str) -> Any:
        """The one request of a call to a method that takes one (then the client's end)."""
        requests = self._requests(iterator, context, method)
        try:
            request = next(requests, _NOTHING)
            more = request is not _NOTHING and next(requests, _NOTHING) is not _NOTHING
        except grpc.RpcError:
            # Stalled and cancelled, or ended by its client: counted as such, not UNKNOWN.
            code = ended_by_client(context)
            context.abort(code, "the call ended while its request was awaited")
        if request is _NOTHING or more:
            many = "none" if request is _NOTHING else "more than one"
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"{method} takes exactly one request, got {many}"
            )
        return request

    def _one_request(
        self,
        behavior: Callable[..., Any],
        method: str,
        response_streaming: bool,
        watches: _Slots | None,
    ) -> Callable[..., Any]:
        """A request-streaming behavior running `behavior` with the call's one request;
        a non-blocking one holds one of `watches` until its call ends."""
        if watches is not None:

            def handle_non_blocking(
                iterator: Iterator[Any], context: grpc.ServicerContext, send: Callable[..., None]
            ) -> None:
                watches.start_until_done(context)
                return behavior(self._request(iterator, context, method), context, send)

            handle_non_blocking.experimental_non_blocking = True
            return handle_non_blocking

        def handle(iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
            result = behavior(self._request(iterator, context, method), context)
            return self._responses(result, context, method) if response_streaming else result

        return handle

    def _stream(
        self,
        behavior: Callable[..., Any],
        method: str,
        response_streaming: bool,
        slots: _Slots,
    ) -> Callable[..., Any]:
        def handle(iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
            slots.start_until_done(context)
            result = behavior(self._requests(iterator, context, method), context)
            return self._responses(result, context, method) if response_streaming else result

        return handle


def _refuse(limit: int) -> Callable[..., Any]:
    def refuse(requests: Any, context: grpc.ServicerContext) -> Any:
        context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"this server keeps at most {limit} such streams open at once; "
            "retry later or on another replica",
        )

    return refuse
