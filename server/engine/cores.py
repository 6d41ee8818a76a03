"""numpy work split over the machine's cores: numpy releases the GIL inside its loops, so
threads that each fill one part of an output finish together in a fraction of the time
one would take (for work large enough to pay for handing it over)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

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
