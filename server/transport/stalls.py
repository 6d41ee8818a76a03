"""A call's waits on its client, timed: its requests read and its responses handed to
gRPC under a stall timer (`StallTimer`), which cancels a call that has waited on its
client for the stall timeout. Time the handler spends computing does not count: only
waiting for a request, or for gRPC to send a response, which the client's reading paces.
A call to a method that takes one request reads it here too (`TimedCall.one_request`), so waiting
for it is timed; a call that ends with no request, or sends a second, is
INVALID_ARGUMENT.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from pergrad.server.admission.pools import Place
from pergrad.server.status import RefusedRequest
from pergrad.server.transport.interceptors import ended_by_client

_LOGGER = logging.getLogger(__name__)
_NOTHING = object()
_STALLED = "{method}: cancelled, its client sent nothing for the stall timeout"
_ENDED = "{method}: cancelled while its request was awaited"


class StallTimer:
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


@dataclass(frozen=True)
class TimedCall:
    """One call's waits on its client, each under the stall timer, and, for an open
    service's call, its place (`waiting`), which may be evicted while it waits."""

    timer: StallTimer
    context: grpc.ServicerContext
    method: str
    waiting: Place | None = None

    def requests(self, iterator: Iterator[Any]) -> Iterator[Any]:
        """The requests, each waited for under the stall timer (an open service's
        requests refused by the guard's open-service parser ending the call). A call
        cancelled as stalled or evicted ends CANCELLED, whichever way gRPC ends its
        request stream (it may end it normally, which the handler would take for the
        client's end)."""
        while True:
            item = self._next(iterator)
            if item is _NOTHING:
                return
            if self.waiting is not None and isinstance(item, RefusedRequest):
                error = item.error
                self.context.abort(grpc.StatusCode[error.code], f"{self.method}: {error}")
            yield item

    def _next(self, iterator: Iterator[Any]) -> Any:
        context, method = self.context, self.method
        token = self.timer.start(context, method)
        if self.waiting is not None:
            self.waiting.waiting(context)
        try:
            return next(iterator, _NOTHING)
        finally:
            if self.waiting is not None:
                self.waiting.waiting(None)
            if not self.timer.end(token):
                context.abort(grpc.StatusCode.CANCELLED, _STALLED.format(method=method))
            if not context.is_active():  # evicted, or ended by its client
                context.abort(grpc.StatusCode.CANCELLED, _ENDED.format(method=method))

    def one_request(
        self, iterator: Iterator[Any], whole: Callable[[Any, Iterator[Any]], Any] | None = None
    ) -> Any:
        """The one request of a call to a method that takes one (then the client's end):
        `whole` reads the rest of it, if it comes in chunks, from the messages after its
        first."""
        requests = self.requests(iterator)
        try:
            request = next(requests, _NOTHING)
            if request is not _NOTHING and whole is not None:
                request = whole(request, requests)
            # A refused request is answered at once, not after the client's end.
            whole_and_sound = request is not _NOTHING and not isinstance(request, RefusedRequest)
            more = whole_and_sound and next(requests, _NOTHING) is not _NOTHING
        except grpc.RpcError:
            # Stalled and cancelled, or ended by its client: counted as such, not UNKNOWN.
            code = ended_by_client(self.context)
            self.context.abort(code, "the call ended while its request was awaited")
        if request is _NOTHING or more:
            many = "none" if request is _NOTHING else "more than one"
            self.context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{self.method} takes exactly one request, got {many}",
            )
        return request

    def responses(self, iterator: Iterator[Any], on_error: Callable[[], None]) -> Iterator[Any]:
        """The responses, each handed to gRPC under the stall timer (until gRPC has sent
        it and asks for the next: the client's reading paces it); `on_error` if they end
        in an error."""
        try:
            for item in iterator:
                token = self.timer.start(self.context, self.method)
                try:
                    yield item
                finally:
                    self.timer.end(token)
        except BaseException:
            on_error()
            raise
