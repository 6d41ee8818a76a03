"""Admission control: a bound on the examples and bytes calls hold at once.

A call holds its request's bytes from the moment it arrives (queued or computing) to its
end, and its result's bytes and its examples while it computes. A caller (a token, or a
connection without tokens) holding bytes already may hold at most half of the bytes in
all: one call may take the whole budget, many calls of one caller cannot. A call over a
bound is refused at once with RESOURCE_EXHAUSTED instead of queueing without limit or running the
process out of memory; its client can retry later or elsewhere. A call that alone
exceeds a bound could never run, and says so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pergrad.server.admission.callers import Held
from pergrad.server.admission.limits import share
from pergrad.server.errors import RequestTooLarge, ResourceExhausted

_BOUNDS = "--max-inflight-examples, --max-inflight-bytes"


class Admission:
    def __init__(self, *, max_examples: int, max_bytes: int) -> None:
        self._max_examples = max_examples
        self._max_bytes = max_bytes
        self.caller_bytes = share(max_bytes)
        self._examples = 0
        self._bytes = 0
        self._by_caller = Held()
        self._lock = threading.Lock()

    @contextmanager
    def admit(
        self, examples: int, nbytes: int, caller: str = "", request_bytes: int = 0
    ) -> Iterator[None]:
        """Hold `examples` and `nbytes` of result for the block, or refuse at once (the
        call's own `request_bytes`, held already, are not another call's)."""
        release = self._take(examples, nbytes, caller, "result bytes", request_bytes)
        try:
            yield
        finally:
            release()

    def hold(self, nbytes: int, caller: str = "") -> Callable[[], None]:
        """Hold a request's `nbytes` until the returned function is called, or refuse."""
        return self._take(0, nbytes, caller, "request bytes")

    def _take(
        self, examples: int, nbytes: int, caller: str, what: str, own: int = 0
    ) -> Callable[[], None]:
        if examples > self._max_examples or own + nbytes > self._max_bytes:
            raise RequestTooLarge(
                f"call needs {examples} examples and {own + nbytes} bytes held (its "
                f"{what} and request); this server admits "
                f"at most {self._max_examples} and {self._max_bytes} ({_BOUNDS}): send "
                "smaller batches"
            )
        with self._lock:
            mine = self._by_caller[caller]
            if mine > own and mine + nbytes > self.caller_bytes:
                raise ResourceExhausted(
                    f"this caller's calls hold {mine} bytes, and with {nbytes} {what} more "
                    f"would hold over half of --max-inflight-bytes ({self.caller_bytes}): "
                    "wait for them to end"
                )
            if (
                self._examples + examples > self._max_examples
                or self._bytes + nbytes > self._max_bytes
            ):
                raise ResourceExhausted(
                    f"server busy: calls hold {self._examples} examples and {self._bytes} "
                    f"bytes ({_BOUNDS}); retry later or on another replica"
                )
            self._examples += examples
            self._bytes += nbytes
            self._by_caller.add(caller, nbytes)
        return lambda: self._give(examples, nbytes, caller)

    def _give(self, examples: int, nbytes: int, caller: str) -> None:
        with self._lock:
            self._examples -= examples
            self._bytes -= nbytes
            self._by_caller.remove(caller, nbytes)
