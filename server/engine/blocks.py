"""Full per-example gradients a block of examples at a time, for streaming: the service
sends block k while the engine fills block k+1, in a few rotating sets of buffers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from pergrad.server.engine.grads import materialize, rows
from pergrad.server.engine.slices import Slice, VariableSpec

DEFAULT_BLOCK_BYTES = 16 << 20


@dataclass(frozen=True)
class SliceResult:
    """Examples [start, stop) of a batch: losses [n] and one [n, *shape] per selected variable."""

    start: int
    stop: int
    losses: np.ndarray
    gradients: list[np.ndarray]


def full_gradient_blocks(
    slices: Iterator[Slice],
    selected: Sequence[VariableSpec],
    slice_size: int,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    buffer_sets: int = 1,
) -> Iterator[SliceResult]:
    """Full per-example gradients of the `selected` variables, from the engine's
    `slices` (of at most `slice_size` examples), in blocks of about `block_bytes`.

    Blocks take turns over `buffer_sets` sets of arrays: a block's arrays are
    overwritten `buffer_sets` blocks later, so consume them before then. Blocks are made
    as they are asked for, some from the batch's own arrays: leave them unchanged until
    the last block.
    """
    bytes_per_example = sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in selected)
    block = max(1, min(slice_size, block_bytes // bytes_per_example))
    buffers = [[np.empty((block, *v.shape), v.dtype) for v in selected] for _ in range(buffer_sets)]
    return _blocks(slices, selected, block, buffers)


def _blocks(
    slices: Iterator[Slice],
    selected: Sequence[VariableSpec],
    block: int,
    buffers: list[list[np.ndarray]],
) -> Iterator[SliceResult]:
    turn = 0
    for part in slices:
        for lo in range(0, part.stop - part.start, block):
            hi = min(lo + block, part.stop - part.start)
            outs = [buffer[: hi - lo] for buffer in buffers[turn % len(buffers)]]
            turn += 1
            for v, out in zip(selected, outs, strict=True):
                materialize(rows(part.grads[v.index], slice(lo, hi)), out)
            yield SliceResult(part.start + lo, part.start + hi, part.losses[lo:hi].copy(), outs)
