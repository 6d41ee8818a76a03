"""numpy work split over the machine's cores: numpy releases the GIL inside its loops, so
threads that each fill one part of an output finish together in a fraction of the time
one would take (for work large enough to pay for handing it over); and numpy's BLAS kept
to one thread (`one_blas_thread`), so that its own threads spin on no core."""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from threadpoolctl import threadpool_limits

_LOGGER = logging.getLogger(__name__)
# Set, they choose how many threads numpy's BLAS runs on.
BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")
CORES = max(1, min(os.cpu_count() or 1, 4))
_PREFIX = "pergrad-cores"
_POOL = ThreadPoolExecutor(max_workers=CORES, thread_name_prefix=_PREFIX)


def parts(count: int, pieces: int, align: int = 1) -> list[slice]:
    """[0, count) in up to `pieces` consecutive slices, each starting at a multiple of
    `align`; empty ones left out."""
    bounds = [min(count, align * round(count * k / pieces / align)) for k in range(pieces)]
    bounds.append(count)
    return [slice(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]


def _on_a_core() -> bool:
    """Whether this thread is one of the cores' own: work it splits runs on it alone
    (handing parts to the pool from the pool could leave every thread waiting)."""
    return threading.current_thread().name.startswith(_PREFIX)


def on_cores(count: int, fill: Callable[[slice], None], *, serial: bool, align: int = 1) -> None:
    """`fill` each part of [0, count), on every core at once unless `serial` (small work,
    where handing it to threads costs more than it saves)."""
    if serial:  # most outputs: no parts to cut
        if count:
            fill(slice(0, count))
        return
    pieces = parts(count, 1 if _on_a_core() else CORES, align)
    if len(pieces) == 1:
        fill(pieces[0])
        return
    for future in [_POOL.submit(fill, piece) for piece in pieces]:
        future.result()


def one_blas_thread() -> None:
    """numpy's BLAS on its calling thread alone, for the whole process, unless the
    operator chose (BLAS_THREAD_VARIABLES): OpenBLAS's workers spin for ~0.1 s after each
    call, so every small reduction of a shared pass left a core busy for 100 ms, taken
    from TensorFlow and every other call. Projections split their products over the cores
    themselves (`on_cores`); the other reductions' products (`dot`, clipped sums) run on
    one core (`benchmarks/reductions.py` with and without OPENBLAS_NUM_THREADS=2)."""
    if any(name in os.environ for name in BLAS_THREAD_VARIABLES):
        return
    threadpool_limits(1, user_api="blas")
    _LOGGER.info("numpy's BLAS on one thread (set OPENBLAS_NUM_THREADS to choose)")
