"""Admission control: a bound on the examples and result bytes in flight at once.

A request over the bound is refused at once with RESOURCE_EXHAUSTED instead of queueing
without limit or running the process out of memory; its client can retry later or
elsewhere. A request that alone exceeds a bound could never run, and says so.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from pergrad.server.errors import ResourceExhausted


class Admission:
    def __init__(self, *, max_examples: int, max_bytes: int) -> None:
        self._max_examples = max_examples
        self._max_bytes = max_bytes
        self._examples = 0
        self._bytes = 0
        self._lock = threading.Lock()

    @contextmanager
    def admit(self, examples: int, nbytes: int) -> Iterator[None]:
        """Hold `examples` and `nbytes` of the budget for the block, or refuse at once."""
        if examples > self._max_examples or nbytes > self._max_bytes:
            raise ResourceExhausted(
                f"request needs {examples} examples and {nbytes} result bytes; this server "
                f"admits at most {self._max_examples} and {self._max_bytes} "
                "(--max-inflight-examples, --max-inflight-bytes): send smaller batches"
            )
        with self._lock:
            if (
                self._examples + examples > self._max_examples
                or self._bytes + nbytes > self._max_bytes
            ):
                raise ResourceExhausted(
                    f"server busy: {self._examples} examples and {self._bytes} result bytes "
                    "in flight; retry later or on another replica"
                )
            self._examples += examples
            self._bytes += nbytes
        try:
            yield
        finally:
            with self._lock:
                self._examples -= examples
                self._bytes -= nbytes
