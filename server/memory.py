"""Giving memory back to the system once a burst of calls has ended.

glibc's malloc keeps what a process frees for reuse, and raises its mmap threshold as
large blocks are freed, so that the arrays of a burst of large calls (requests, results,
a reduction's working set) end up in its heaps: without a trim, the RSS a burst reached
stays for the process's life. `in_flight()` marks a call's work; IDLE_S after the
process's last such call ends, if none has started since, `malloc_trim(0)` hands the
heaps' free pages back. Memory is the process's, so this is one thread per process,
whatever number of servers it runs. Where the C library has no `malloc_trim` (musl,
macOS) nothing is trimmed.

A trim returns only whole free pages. glibc gives each thread an arena of its own at its
first allocation, up to 8 per core, so a burst of calls on many threads leaves its free
memory scattered over as many arenas, in pages each still partly used: a server that
`limit_arenas()` at start keeps ARENAS of them, the main one included (measured on 2
cores: 4 concurrent 46 MB `dot` calls left +48 to +99 MB after the trim with glibc's
default, -4 to +23 MB with 2, and the admission load test of `benchmarks/load.py`
answered 6.8-7.1 calls/s instead of 5.8, at a peak RSS of 807 MB instead of 904-913; on
many cores the one arena the threads share may be contended: measure, and set
MALLOC_ARENA_MAX). An operator's own MALLOC_ARENA_MAX or glibc.malloc.arena_max tunable
wins.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# How long the process stays idle before its heaps are trimmed (a trim walks every
# arena: not after each call of a steady stream).
IDLE_S = 0.5


_LOGGER = logging.getLogger(__name__)

# glibc's mallopt parameter for the arena limit, and the limit a server sets.
M_ARENA_MAX = -8
ARENAS = 2


@functools.cache
def _c_library() -> ctypes.CDLL | None:
    """The C library, looked up once (`find_library` runs `ldconfig`)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def _libc(name: str) -> Callable[..., int] | None:
    """The C library's function `name`, or None where it has none."""
    return getattr(_c_library(), name, None)


def limit_arenas() -> None:
    """At most ARENAS malloc arenas from now on, unless the operator chose a number (glibc
    read it at start). Called before the server's threads start: glibc fixes its limit
    once more than 8 arenas exist."""
    chosen = "MALLOC_ARENA_MAX" in os.environ or "arena_max" in os.environ.get("GLIBC_TUNABLES", "")
    mallopt = _libc("mallopt")
    if chosen or mallopt is None:
        return
    if mallopt(M_ARENA_MAX, ARENAS):
        _LOGGER.info("malloc arenas limited to %d (set MALLOC_ARENA_MAX to choose)", ARENAS)
    else:
        _LOGGER.warning("the C library refused to limit its malloc arenas")


class _Trimmer:
    """Trims once the last call has ended IDLE_S ago. A call's start and end only count
    (a lock, no thread woken): the trimmer's thread is woken when calls end only while it
    sleeps after a trim, then looks every IDLE_S at most until the process is idle
    (woken at every end, it took a sequential client's calls 2 context switches each)."""

    def __init__(self, trim: Callable[[int], int]) -> None:
        self._trim = trim
        self._calls = 0
        self._last_end = 0.0
        self._asleep = True
        self._lock = threading.Lock()
        self._ended = threading.Event()
        threading.Thread(target=self._run, name="pergrad-trim", daemon=True).start()

    def started(self) -> None:
        with self._lock:
            self._calls += 1

    def ended(self) -> None:
        with self._lock:
            self._calls -= 1
            self._last_end = time.monotonic()
            wake = self._asleep and self._calls == 0
            if wake:
                self._asleep = False
        if wake:
            self._ended.set()

    def _run(self) -> None:
        while True:
            self._ended.wait()
            self._ended.clear()
            while (wait := self._idle_wait()) > 0:
                time.sleep(wait)
            self._trim(0)

    def _idle_wait(self) -> float:
        """0 once the process has been idle IDLE_S (the trimmer then sleeps until a call
        ends), else how long to wait before looking again."""
        with self._lock:
            if self._calls:
                return IDLE_S
            left = IDLE_S - (time.monotonic() - self._last_end)
            self._asleep = left <= 0
            return max(left, 0.0)


_STARTING = threading.Lock()


def _trimmer() -> _Trimmer | None:
    """The process's trimmer, started at its first call (None without `malloc_trim`)."""
    with _STARTING:
        return _started()


@functools.cache
def _started() -> _Trimmer | None:
    trim = _libc("malloc_trim")
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
