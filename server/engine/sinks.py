"""Where one request's per-example results go as slices of them are computed: full
gradients written into the result's arrays, or a reduction fed. A sink sees only its
own request's rows, so requests that share a pass (`group.shared_rows`) each get
exactly what they would alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from pergrad.server.engine import reductions
from pergrad.server.engine.grads import Grad, materialize
from pergrad.server.engine.in_pass import InPass
from pergrad.server.engine.slices import VariableSpec
from pergrad.wire.casting import dtype_named
from pergrad.wire.results import GradientResult


class Sink(Protocol):
    size: int

    @property
    def in_pass(self) -> InPass | None:
        """What the pass computes instead of gradients (`Reduced.add_in_pass`), if any."""

    def add(self, start: int, losses: np.ndarray, grads: Sequence[Grad]) -> None:
        """Rows [start, start + len(losses)) of the request; grads in model order."""

    def finish(self) -> GradientResult: ...


class FullGradients:
    in_pass = None  # full gradients leave the pass whole

    """Writes every selected variable's per-example gradient into the result's arrays
    (`out`, a previous result of the same shape, is refilled), cast to `wire_dtype`."""

    def __init__(
        self,
        size: int,
        selected: Sequence[VariableSpec],
        loss_dtype: np.dtype,
        model: str,
        *,
        out: GradientResult | None = None,
        wire_dtype: str | None = None,
    ) -> None:
        self.size, self._selected, self._wire = size, selected, wire_dtype
        self.result = out if out is not None else _allocate(size, selected, loss_dtype, model)
        _check_out(self.result, size, selected)

    def add(self, start: int, losses: np.ndarray, grads: Sequence[Grad]) -> None:
        stop = start + len(losses)
        self.result.losses[start:stop] = losses
        for v in self._selected:
            materialize(grads[v.index], self.result.gradients[v.name][start:stop])

    def finish(self) -> GradientResult:
        if self._wire:  # in-process there is no wire: the gradients' dtype
            dtype = dtype_named(self._wire)
            gradients = self.result.gradients
            self.result.gradients = {k: g.astype(dtype) for k, g in gradients.items()}
        return self.result


class Reduced:
    """Feeds a reduction the selected variables' per-example gradients."""

    def __init__(
        self,
        size: int,
        selected: Sequence[VariableSpec],
        reduction: reductions.Reduction,
        loss_dtype: np.dtype,
        model: str,
    ) -> None:
        self.size, self._selected, self._reduction, self._model = size, selected, reduction, model
        self._losses = np.empty(size, loss_dtype)
        self._in_pass = reductions.in_pass(reduction)

    def add(self, start: int, losses: np.ndarray, grads: Sequence[Grad]) -> None:
        self._losses[start : start + len(losses)] = losses
        self._reduction.add({v.name: grads[v.index] for v in self._selected})

    @property
    def in_pass(self) -> InPass | None:
        """What to compute inside the pass instead of gradients, if the reduction can."""
        if self._in_pass is None:
            return None
        return InPass(tuple(v.index for v in self._selected), self._in_pass.IN_PASS_CLIP)

    @property
    def max_norm(self) -> float:
        """The in-pass function's clip bound: the reduction's (0 where it only norms)."""
        return self._in_pass.max_norm if self._in_pass is not None else 0.0

    def add_in_pass(self, start: int, losses: np.ndarray, outputs: dict) -> None:
        """Rows [start, start + len(losses)): losses and the `in_pass` outputs (`squares`
        [V, n] and, for clipped sums, `sums`, in the order of the selected variables)."""
        self._losses[start : start + len(losses)] = losses
        names = [v.name for v in self._selected]
        squares = dict(zip(names, outputs["squares"], strict=True))
        sums = dict(zip(names, outputs.get("sums", ()), strict=False))
        assert self._in_pass is not None, "add_in_pass on a reduction the pass cannot make"
        self._in_pass.add_in_pass(squares, sums)

    def finish(self) -> GradientResult:
        return GradientResult(self._losses, model=self._model, **self._reduction.finish())


def _allocate(
    batch: int, selected: Sequence[VariableSpec], loss_dtype: np.dtype, model: str
) -> GradientResult:
    return GradientResult(
        np.empty(batch, loss_dtype),
        gradients={v.name: np.empty((batch, *v.shape), v.dtype) for v in selected},
        model=model,
    )


def _check_out(result: GradientResult, batch: int, selected: Sequence[VariableSpec]) -> None:
    for v in selected:
        array = result.gradients.get(v.name)
        if (
            array is None
            or array.shape != (batch, *v.shape)
            or array.dtype != v.dtype
            or not array.flags.c_contiguous
            or not array.flags.writeable
        ):
            raise ValueError(f"out= does not fit a batch of {batch}: see {v.name!r}")
