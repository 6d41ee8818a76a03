"""server/memory.py's arena limit, seen in glibc's own account of its heaps
(`malloc_info`) after eight threads allocate at once, in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys

from pergrad.server.memory import ARENAS

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
