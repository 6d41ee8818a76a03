"""Keeping idle and slow callers from holding the server's capacity.

A sync gRPC server runs each call in a worker thread; a call that waits on its client
(a stream that sends no next request, a client that reads no response) holds its worker
for as long as the client likes. This interceptor:
- cancels a call that has waited on its client for `stall_timeout_s` (time the handler
  spends computing does not count: only waiting for a request, or for gRPC to send a
  response, which the client's reading paces);
- admits at most `max_streams` request-streaming calls at once (StreamPerExampleGradients,
  SetWeights), and at most `max_open_streams` of the open services' (reflection), which
  run on a pool of their own: a caller without a token cannot reach the workers;
- leaves non-blocking handlers (health Watch) alone: they hold no thread.
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

from pergrad.server.handlers import behavior_of, replaced

_LOGGER = logging.getLogger(__name__)

OPEN_SERVICES = frozenset(
    {
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
        "grpc.reflection.v1.ServerReflection",
    }
)


def service_of(method: str) -> str:
    """The service part of a full method name ("/pergrad.v1.GradientService/ListModels")."""
    return method.lstrip("/").rpartition("/")[0]


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

    def end(self, token: int) -> None:
        with self._lock:
            self._waiting.pop(token, None)

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


class CallGuard(grpc.ServerInterceptor):
    def __init__(
        self,
        *,
        stall_timeout_s: float,
        max_streams: int,
        max_open_streams: int,
        on_stall: Callable[[str], None] = lambda method: None,
    ) -> None:
        self._waits = _Waits(stall_timeout_s, on_stall)
        self._slots = {False: _Slots(max_streams), True: _Slots(max_open_streams)}
        self._open_pool = ThreadPoolExecutor(
            max_workers=max(1, max_open_streams), thread_name_prefix="pergrad-open"
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
        behavior = behavior_of(handler) if handler is not None else None
        if behavior is None or getattr(behavior, "experimental_non_blocking", False):
            return handler
        method = handler_call_details.method
        open_service = service_of(method) in OPEN_SERVICES
        slots = self._slots[open_service] if handler.request_streaming else None
        if slots is not None and not slots.reserve():
            return replaced(handler, _refusal(slots.limit), request_deserializer=None)
        watched = self._watched(behavior, method, handler, slots)
        if open_service:
            watched.experimental_thread_pool = self._open_pool
        return replaced(handler, watched)

    def _watched(
        self,
        behavior: Callable[..., Any],
        method: str,
        handler: grpc.RpcMethodHandler,
        slots: _Slots | None,
    ) -> Callable[..., Any]:
        waits = self._waits

        def requests(iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            while True:
                token = waits.start(context, method)
                try:
                    item = next(iterator)
                except StopIteration:
                    return
                finally:
                    waits.end(token)
                yield item

        def responses(iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            for item in iterator:
                token = waits.start(context, method)  # until gRPC has sent it and asks again
                try:
                    yield item
                finally:
                    waits.end(token)

        def handle(request: Any, context: grpc.ServicerContext) -> Any:
            if slots is not None:
                slots.start()
                context.add_callback(slots.end)
            if handler.request_streaming:
                request = requests(request, context)
            result = behavior(request, context)
            return responses(result, context) if handler.response_streaming else result

        return handle


def _refusal(limit: int) -> Callable[..., Any]:
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"this server keeps at most {limit} such streams open at once; "
            "retry later or on another replica",
        )

    return refuse
