"""server/memory.py's arena limit, seen in glibc's own account of its heaps
(`malloc_info`) after eight threads allocate at once, in a process of its own; and when
the heaps are trimmed, seen by a trimmer given a trim that records its calls."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from pergrad.server.memory import ARENAS, IDLE_S, _Trimmer

_HEAPS_AFTER_EIGHT_THREADS = """
import ctypes, ctypes.util, sys, tempfile, threading
libc = ctypes.CDLL(ctypes.util.find_library("c"))
if sys.argv[1] == "limit":
    from pergrad.server.memory import limit_arenas
    limit_arenas()
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
start = threading.Barrier(8)
def allocate():
    start.wait()
    blocks = [libc.malloc(4096) for _ in range(20000)]
    for block in blocks:
        libc.free(block)
threads = [threading.Thread(target=allocate) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
libc.fopen.restype = ctypes.c_void_p
with tempfile.NamedTemporaryFile("r") as report:
    stream = ctypes.c_void_p(libc.fopen(report.name.encode(), b"w"))
    libc.malloc_info(0, stream)
    libc.fclose(stream)
    print(report.read().count("<heap nr="))
"""


def _heaps(mode: str, **env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "GLIBC_TUNABLES")}
    done = subprocess.run(
        [sys.executable, "-c", _HEAPS_AFTER_EIGHT_THREADS, mode],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip())


def test_eight_threads_allocating_at_once_get_arenas_of_their_own_by_default() -> None:
    """The control: without the limit glibc makes more arenas than ARENAS."""
    assert _heaps("none") > ARENAS


def test_limit_arenas_keeps_eight_threads_to_its_arenas() -> None:
    assert _heaps("limit") == ARENAS


def test_an_operators_malloc_arena_max_wins() -> None:
    assert _heaps("limit", MALLOC_ARENA_MAX=str(ARENAS + 1)) == ARENAS + 1


class _Trims:
    """A trim function recording when it was called."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.called = threading.Event()

    def __call__(self, pad: int) -> int:
        self.times.append(time.monotonic())
        self.called.set()
        return 1


def test_the_heaps_are_trimmed_once_idle_s_after_the_last_call_ends() -> None:
    trims = _Trims()
    trimmer = _Trimmer(trims)
    for _ in range(3):  # a steady stream of calls, then none
        trimmer.started()
        last_end = time.monotonic()
        trimmer.ended()
    assert trims.called.wait(30)
    time.sleep(3 * IDLE_S)
    assert len(trims.times) == 1
    assert trims.times[0] - last_end >= IDLE_S


def test_no_trim_while_a_call_runs_and_one_after_it_ends() -> None:
    trims = _Trims()
    trimmer = _Trimmer(trims)
    trimmer.started()
    trimmer.ended()  # the trimmer wakes, and looks until the process is idle
    trimmer.started()
    assert not trims.called.wait(4 * IDLE_S)
    trimmer.ended()
    assert trims.called.wait(30)


def test_calls_after_a_trim_are_trimmed_after_again() -> None:
    trims = _Trims()
    trimmer = _Trimmer(trims)
    trimmer.started()
    trimmer.ended()
    assert trims.called.wait(30)
    trims.called.clear()
    trimmer.started()
    trimmer.ended()
    assert trims.called.wait(30)
    assert len(trims.times) == 2
