"""numpy work split over the machine's cores: numpy releases the GIL inside its loops, so
threads that each fill one part of an output finish together in a fraction of the time
one would take (for work large enough to pay for handing it over)."""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from threadpoolctl import threadpool_limits

_LOGGER = logging.getLogger(__name__)
# Set, they choose how many threads numpy's BLAS runs on.
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")
CORES = max(1, min(os.cpu_count() or 1, 4))
_POOL = ThreadPoolExecutor(max_workers=CORES, thread_name_prefix="pergrad-cores")


def parts(count: int, pieces: int, align: int = 1) -> list[slice]:
    """[0, count) in up to `pieces` consecutive slices, each starting at a multiple of
    `align`; empty ones left out."""
    bounds = [min(count, align * round(count * k / pieces / align)) for k in range(pieces)]
    bounds.append(count)
    return [slice(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]


def on_cores(count: int, fill: Callable[[slice], None], *, serial: bool, align: int = 1) -> None:
    """`fill` each part of [0, count), on every core at once unless `serial` (small work,
    where handing it to threads costs more than it saves)."""
    pieces = parts(count, 1 if serial else CORES, align)
    if len(pieces) == 1:
        fill(pieces[0])
        return
    for future in [_POOL.submit(fill, piece) for piece in pieces]:
        future.result()


def one_blas_thread() -> None:
    """numpy's BLAS on its calling thread alone, for the whole process, unless the
    operator chose (BLAS_THREAD_VARIABLES): OpenBLAS's workers spin for ~0.1 s after each
    call, so every small reduction of a shared pass left a core busy for 100 ms, taken
    from TensorFlow and every other call; numpy work worth splitting is split by
    `on_cores`."""
    if any(name in os.environ for name in BLAS_THREAD_VARIABLES):
        return
    threadpool_limits(1, user_api="blas")
    _LOGGER.info("numpy's BLAS on one thread (set OPENBLAS_NUM_THREADS to choose)")
