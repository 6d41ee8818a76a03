"""Small requests computed together: passes of a fixed number of examples, shared.

A gradient server's requests are mostly small, and each pass of the model has a fixed
cost; requests for the same weights that arrive together can share passes. Each pass
holds exactly `granule` examples (zero rows pad it), each request's rows whole in one
pass, fed to its own sink (`sinks`): its result is the same, to the bit, whatever
shares its pass (measured here: the arithmetic of a pass of fixed size does not depend
on a row's place in it, with XLA or without), and the same as when it is alone in one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from pergrad.server.engine.batch import Batch
from pergrad.server.engine.engine import Engine
from pergrad.server.engine.grads import rows
from pergrad.server.engine.sinks import Sink
from pergrad.server.errors import Cancelled, InvalidArgument
from pergrad.wire.results import GradientResult


@dataclass(frozen=True)
class Job:
    """One request of a group (`compute_group`): its batch, where its results go,
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


def _padded(parts: Sequence[np.ndarray], size: int) -> np.ndarray:
    """The parts one after the other, then zero rows up to `size`."""
    count = sum(len(p) for p in parts)
    padding = np.zeros((size - count, *parts[0].shape[1:]), parts[0].dtype)
    return np.concatenate([*parts, padding])


def compute_group(
    engine: Engine,
    jobs: Sequence[Job],
    *,
    granule: int,
    trainable: Sequence[tf.Tensor] | None = None,
) -> list[GradientResult | Exception]:
    """Each job's result, or the error that ended it alone; jobs of fewer than `granule`
    examples each, computed with the same weights."""
    weights = engine.weights(trainable)
    outcome: list[GradientResult | Exception | None] = [None] * len(jobs)
    for pack in packs([job.batch.size for job in jobs], granule):
        live = []
        for i in pack:
            if jobs[i].cancelled is not None and jobs[i].cancelled():
                outcome[i] = Cancelled("call cancelled or past its deadline before its pass")
            else:
                live.append(i)
        try:
            _feed(engine, weights, [jobs[i] for i in live], granule)
        except InvalidArgument as err:
            if len(live) == 1:
                outcome[live[0]] = err
                continue
            for i in live:  # which request did the model refuse? each alone, then
                try:
                    _feed(engine, weights, [jobs[i]], granule)
                except InvalidArgument as own:
                    outcome[i] = own
    for i, job in enumerate(jobs):
        if outcome[i] is None:
            try:
                outcome[i] = job.sink.finish()
            except Exception as err:
                outcome[i] = err
    return outcome


def _feed(
    engine: Engine, weights: tuple[tf.Tensor, ...], jobs: Sequence[Job], granule: int
) -> None:
    """One pass of `granule` examples holding `jobs`' batches, fed to their sinks."""
    inputs = len(jobs[0].batch.xs)
    xs = tuple(_padded([job.batch.xs[k] for job in jobs], granule) for k in range(inputs))
    y = _padded([job.batch.y for job in jobs], granule)
    losses, grads = engine.run_pass(weights, xs, y, granule)
    offset = 0
    for job in jobs:
        part = slice(offset, offset + job.batch.size)
        job.sink.add(0, losses[part], [rows(g, part) for g in grads])
        offset += job.batch.size
