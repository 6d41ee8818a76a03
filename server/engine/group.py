"""Small requests computed together: passes of at most `granule` examples, shared.

A gradient server's requests are mostly small, and each pass of the model has a fixed
cost; requests for the same weights that arrive together can share passes. Each
request's rows sit whole in one pass, fed to its own sink (`sinks`), and its result is
the same, to the bit, whatever shares its pass: the arithmetic of a pass of a given
size does not depend on a row's place in it (measured, with XLA or without), and a pass
only takes a size whose rows come out bit-identical to a pass of `granule`'s
(`same_bits_sizes`; zero rows pad a pass up to it). oneDNN and Eigen pick their kernels
and blocking by a pass's size, so which sizes qualify depends on the model and the CPU:
on one machine mnist_cnn's rows agreed for every size from 4 to 128; on another (AVX2,
no AVX-512) for 5, 11, 12, 16, 17, 23, 24, 28, 29, 35, ... but not 32, and mnist_mlp's
for 47, 48, 52, ..., 64 and up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from pergrad.server.engine.batch import Batch
from pergrad.server.engine.engine import Engine
from pergrad.server.engine.grads import Grad, rows
from pergrad.server.engine.sinks import Sink
from pergrad.server.errors import Cancelled, InvalidArgument
from pergrad.wire.results import GradientResult

# Every size up to this is probed for shared passes where a pass takes any size.
FINE_SIZES = 64


@dataclass(frozen=True)
class Job:
    """One request of a group (`shared_rows`): its batch, where its results go,
    and whether its caller still wants them."""

    batch: Batch
    sink: Sink
    cancelled: Callable[[], bool] | None = None


def packs(sizes: Sequence[int], granule: int) -> list[list[int]]:
    """Requests (by index, in order) gathered into passes of at most `granule` examples,
    none split: each pass takes the requests that still fit, first come first."""
    groups: list[list[int]] = []
    room = 0
    for index, size in enumerate(sizes):
        if not groups or size > room:
            groups.append([])
            room = granule
        groups[-1].append(index)
        room -= size
    return groups


def same_bits_sizes(
    engine: Engine, granule: int, trainable: Sequence[tf.Tensor] | None = None
) -> tuple[int, ...]:
    """The sizes up to `granule` (and `granule`) whose passes give every row
    bit-identical to the same row in a pass of `granule`, on a random probe batch."""
    xs, y = _probe(engine, granule)
    weights = engine.passes.weights(trainable)
    want = engine.passes.run_pass(weights, xs, y, granule)
    sizes = [granule]
    for size in candidate_sizes(granule, every_size=engine.passes.takes_any_pass_size):
        got = engine.passes.run_pass(weights, tuple(x[:size] for x in xs), y[:size], size)
        if _same_rows(got, want, size):
            sizes.append(size)
    return tuple(sorted(sizes))


def candidate_sizes(granule: int, *, every_size: bool) -> list[int]:
    """The sizes below `granule` worth probing: the powers of two, and where a pass takes
    any size (no XLA, which compiles one function per size), every size up to
    FINE_SIZES too. Those spare a small request most of its padding (mnist_cnn's 8
    examples in a pass of 11 instead of 16, 32 in 35 instead of 64), for probe passes of
    1 + 2 + ... + 64 examples, about 16 passes of 128, once per model."""
    powers = [1 << k for k in range((granule - 1).bit_length())]
    fine = range(1, min(FINE_SIZES, granule - 1) + 1) if every_size else []
    return sorted(set(powers) | set(fine))


def _probe(engine: Engine, size: int) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
    """Random float inputs, integer inputs of ones (a valid id and an unmasked position
    for any model), labels spread over the classes."""
    rng = np.random.default_rng(0)
    xs = tuple(
        rng.standard_normal((size, *(d or 1 for d in s.shape))).astype(s.dtype)
        if s.dtype.kind == "f"
        else np.ones((size, *(d or 1 for d in s.shape)), s.dtype)
        for s in engine.input_specs
    )
    spec = engine.label_spec
    shape = (size, *(d or 1 for d in spec.shape))
    if spec.dtype.kind == "f":
        y = rng.standard_normal(shape).astype(spec.dtype)
    else:
        y = rng.integers(0, max(spec.num_classes, 1), shape).astype(spec.dtype)
    return xs, y


def _same_rows(
    got: tuple[np.ndarray, list[Grad]], want: tuple[np.ndarray, list[Grad]], count: int
) -> bool:
    """Rows [0, count) of two passes' losses and gradients (factors compared as such)."""
    part = slice(0, count)
    pairs = [(got[0], want[0])]
    for mine, theirs in zip(got[1], want[1], strict=True):
        pairs += zip(tf.nest.flatten(mine), tf.nest.flatten(theirs), strict=True)
    return all(np.array_equal(a[part], b[part]) for a, b in pairs)


def pass_size(rows_waiting: int, sizes: Sequence[int]) -> int:
    """The smallest allowed pass size that holds `rows_waiting` rows."""
    return next(size for size in sizes if size >= rows_waiting)


def _padded(parts: Sequence[np.ndarray], size: int) -> np.ndarray:
    """The parts one after the other, then zero rows up to `size`."""
    count = sum(len(p) for p in parts)
    padding = np.zeros((size - count, *parts[0].shape[1:]), parts[0].dtype)
    return np.concatenate([*parts, padding])


@dataclass(frozen=True)
class Rows:
    """A job's rows of a shared pass: its losses and each variable's gradient, model order."""

    losses: np.ndarray
    grads: list[Grad]

    def into(self, sink: Sink) -> GradientResult:
        """The job's result: its rows fed to its sink (the reduction, the noise)."""
        sink.add(0, self.losses, self.grads)
        return sink.finish()


def shared_rows(
    engine: Engine,
    jobs: Sequence[Job],
    *,
    granule: int,
    sizes: Sequence[int] = (),
    trainable: Sequence[tf.Tensor] | None = None,
) -> list[Rows | Exception]:
    """Each job's rows of the passes, or the error that ended it alone; jobs of fewer than
    `granule` examples each, computed with the same weights, in passes of the smallest of
    `sizes` (ascending, `same_bits_sizes`; default: `granule` only) that holds them. The
    rows are not yet reduced: each caller reduces its own (`Rows.into`), beside the others."""
    sizes = sizes or (granule,)
    weights = engine.passes.weights(trainable)
    outcome: dict[int, Rows | Exception] = {}
    for pack in packs([job.batch.size for job in jobs], granule):
        live = []
        for i in pack:
            cancelled = jobs[i].cancelled
            if cancelled is not None and cancelled():
                outcome[i] = Cancelled("call cancelled or past its deadline before its pass")
            else:
                live.append(i)
        if not live:
            continue
        try:
            shared = _pass(engine, weights, [jobs[i] for i in live], sizes)
            for i, rows_of in zip(live, shared, strict=True):
                outcome[i] = rows_of
        except InvalidArgument as err:
            if len(live) == 1:
                outcome[live[0]] = err
                continue
            for i in live:  # which request did the model refuse? each alone, then
                try:
                    outcome[i] = _pass(engine, weights, [jobs[i]], sizes)[0]
                except InvalidArgument as own:
                    outcome[i] = own
    return [outcome[i] for i in range(len(jobs))]


def _pass(
    engine: Engine, weights: tuple[tf.Tensor, ...], jobs: Sequence[Job], sizes: Sequence[int]
) -> list[Rows]:
    """One pass holding `jobs`' batches, of the smallest of `sizes` that holds them: each
    job's rows of it."""
    size = pass_size(sum(job.batch.size for job in jobs), sizes)
    inputs = len(jobs[0].batch.xs)
    xs = tuple(_padded([job.batch.xs[k] for job in jobs], size) for k in range(inputs))
    y = _padded([job.batch.y for job in jobs], size)
    losses, grads = engine.passes.run_pass(weights, xs, y, size)
    parts, offset = [], 0
    for job in jobs:
        part = slice(offset, offset + job.batch.size)
        parts.append(Rows(losses[part], [rows(g, part) for g in grads]))
        offset += job.batch.size
    return parts
