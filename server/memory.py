"""Giving memory back to the system once a burst of calls has ended.

glibc's malloc keeps what a process frees for reuse, and raises its mmap threshold as
large blocks are freed, so that the arrays of a burst of large calls (requests, results,
a reduction's working set) end up in its heaps: without a trim, the RSS a burst reached
stays for the process's life. `in_flight()` marks a call's work; IDLE_S after the
process's last such call ends, if none has started since, `malloc_trim(0)` hands the
heaps' free pages back. Memory is the process's, so this is one thread per process,
whatever number of servers it runs. Where the C library has no `malloc_trim` (musl,
macOS) nothing is trimmed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# How long the process stays idle before its heaps are trimmed (a trim walks every
# arena: not after each call of a steady stream).
IDLE_S = 0.5


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


class _Trimmer:
    def __init__(self, trim: Callable[[int], int]) -> None:
        self._trim = trim
        self._calls = 0
        self._lock = threading.Lock()
        self._ended = threading.Event()
        threading.Thread(target=self._run, name="pergrad-trim", daemon=True).start()

    def started(self) -> None:
        with self._lock:
            self._calls += 1

    def ended(self) -> None:
        with self._lock:
            self._calls -= 1
            if self._calls == 0:
                self._ended.set()

    def _run(self) -> None:
        while True:
            self._ended.wait()
            self._ended.clear()
            if self._ended.wait(IDLE_S):
                continue  # another call ended meanwhile: wait IDLE_S from that one
            with self._lock:
                idle = self._calls == 0
            if idle:
                self._trim(0)


_STARTING = threading.Lock()


def _trimmer() -> _Trimmer | None:
    """The process's trimmer, started at its first call (None without `malloc_trim`)."""
    with _STARTING:
        return _started()


@functools.cache
def _started() -> _Trimmer | None:
    trim = _malloc_trim()
    return None if trim is None else _Trimmer(trim)


@contextmanager
def in_flight() -> Iterator[None]:
    """A call's work: once the process's last one ends and IDLE_S pass, its heaps are
    trimmed."""
    trimmer = _trimmer()
    if trimmer is None:
        yield
        return
    trimmer.started()
    try:
        yield
    finally:
        trimmer.ended()
