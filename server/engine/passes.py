"""What the server calls of an engine (`Engine.passes`): the compiled pass run on a
snapshot's weights (or the model's own) over a checked `Batch`, slice by slice, into a
sink that keeps one request's results (full gradients, or a reduction computed inside
the pass where it can be), or in blocks for a result streamed as it is made; and the
single passes that shared passes are made of (`group.py`). A user calls `Engine`.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from pergrad.server.engine.batch import Batch
from pergrad.server.engine.blocks import SliceResult, full_gradient_blocks
from pergrad.server.engine.compiled import CompiledPass
from pergrad.server.engine.grads import Grad
from pergrad.server.engine.reductions import ReductionRegistry
from pergrad.server.engine.sinks import FullGradients, Reduced, Sink
from pergrad.server.engine.slices import Slice, VariableSpec
from pergrad.server.errors import Cancelled, InvalidArgument
from pergrad.wire.catalogue import CATALOGUE, NONE, CheckedOptions, OptionError, Reduction
from pergrad.wire.results import GradientResult
from pergrad.wire.text import quoted

# Unknown variable names an error quotes, at most.
QUOTED_NAMES = 3


def _some(names: set[str]) -> str:
    """A few of `names`, each quoted short, and how many more: a request may name
    millions, and sorting and quoting all of 100,000 took 45 ms with the GIL held."""
    first = heapq.nsmallest(QUOTED_NAMES, names)
    more = f" and {len(names) - len(first)} more" if len(names) > len(first) else ""
    return f"[{', '.join(map(quoted, first))}]{more}"


def _first_line(err: tf.errors.OpError) -> str:
    """TensorFlow's message without its graph-node and function decorations."""
    line = err.message.strip().splitlines()[0] if err.message.strip() else type(err).__name__
    return re.sub(r"\{\{[^}]*\}\}\s*", "", line).strip()


def _stop_if(cancelled: Callable[[], bool] | None, done: int, total: int) -> None:
    if cancelled is not None and cancelled():
        raise Cancelled(f"call cancelled or past its deadline; stopped after {done} of {total}")


class Passes:
    """One model's compiled pass, as the server drives it."""

    def __init__(
        self,
        model_name: str,
        variables: tuple[VariableSpec, ...],
        compiled: CompiledPass,
        read_weights: Callable[[], list[tf.Tensor]],
        *,
        slice_size: int,
        reductions: ReductionRegistry,
        loss_dtype: np.dtype,
    ) -> None:
        self._model_name = model_name
        self.variables = variables
        self._compiled = compiled
        self._read_weights = read_weights
        self.slice_size = slice_size
        self.reductions = reductions
        self.loss_dtype = loss_dtype

    @property
    def takes_any_pass_size(self) -> bool:
        """Whether a pass runs at its own size, not padded to a compiled one."""
        return self._compiled.takes_any_size

    def initial_weights(self) -> tuple[tf.Tensor, ...]:
        """The model's own trainable values now, as immutable tensors (`values_reader`:
        `benchmarks/zoo.py`, mlp 1.31x vectorized_map's time read one by one, 0.97x so)."""
        return tuple(self._read_weights())

    def weights(self, trainable: Sequence[tf.Tensor] | None) -> tuple[tf.Tensor, ...]:
        """`trainable` (a snapshot's), or the model's own values."""
        return tuple(trainable) if trainable is not None else self.initial_weights()

    def select(self, variables: Sequence[str] | None) -> tuple[VariableSpec, ...]:
        """The named variables in model order (all for None); unknown names are refused."""
        if variables is None:
            return self.variables
        wanted = set(variables)
        unknown = wanted.difference(v.name for v in self.variables)
        if unknown or not variables:
            raise InvalidArgument(
                f"variables: unknown {_some(unknown) if unknown else 'empty filter'}; the "
                f"model has {[v.name for v in self.variables]}"
            )
        return tuple(v for v in self.variables if v.name in wanted)

    def slices(self, batch: Batch, trainable: Sequence[tf.Tensor] | None) -> Iterator[Slice]:
        weights = self.weights(trainable)
        for start in range(0, batch.size, self.slice_size):
            stop = min(start + self.slice_size, batch.size)
            xs, y = batch.rows(slice(start, stop))
            yield Slice(start, stop, *self.run_pass(weights, xs, y, stop - start))

    def run_pass(
        self, weights: tuple[tf.Tensor, ...], xs: tuple[np.ndarray, ...], y: np.ndarray, count: int
    ) -> tuple[np.ndarray, list[Grad]]:
        """One compiled pass: losses and every variable's numpy per-example gradient, as
        read-only views (see `Slice`)."""
        try:
            losses, grads = self._compiled(weights, xs, y)
        except tf.errors.InvalidArgumentError as err:
            raise InvalidArgument(f"the model refused the batch: {_first_line(err)}") from None
        return losses, [self._grad_or_zeros(grads, v, count) for v in self.variables]

    @staticmethod
    def _grad_or_zeros(grads: dict[str, Grad], variable: VariableSpec, count: int) -> Grad:
        """A ruled layer that the forward pass never called has zero gradients."""
        if variable.name in grads:
            return grads[variable.name]
        return np.zeros((count, *variable.shape), variable.dtype)

    def blocks(
        self,
        batch: Batch,
        *,
        variables: Sequence[str] | None = None,
        trainable: Sequence[tf.Tensor] | None = None,
        **kwargs: Any,
    ) -> Iterator[SliceResult]:
        """Full per-example gradients of `batch` in blocks (`blocks.full_gradient_blocks`),
        of the `variables` selected (None: all), on `trainable` values (None: the
        model's)."""
        selected = self.select(variables)
        slices = self.slices(batch, trainable)
        return full_gradient_blocks(slices, selected, self.slice_size, **kwargs)

    def sink(
        self,
        size: int,
        *,
        reduction: str = NONE,
        variables: Sequence[str] | None = None,
        out: GradientResult | None = None,
        **options: Any,
    ) -> Sink:
        """Where the results of a request of `size` examples go, its options checked here:
        the engine is the edge that receives them in-process."""
        try:
            entry = CATALOGUE.get(reduction)
            checked = CATALOGUE.check_options(entry, options)
        except OptionError as err:
            raise InvalidArgument(str(err)) from None
        return self.checked_sink(size, entry, checked, variables=variables, out=out)

    def checked_sink(
        self,
        size: int,
        reduction: Reduction,
        options: CheckedOptions,
        *,
        variables: Sequence[str] | None = None,
        out: GradientResult | None = None,
    ) -> Sink:
        """`sink` for options checked where they arrived (the server's request parser)."""
        selected = self.select(variables)
        name = self._model_name
        if reduction.name == NONE:
            return FullGradients(
                size, selected, self.loss_dtype, name, out=out, wire_dtype=options["wire_dtype"]
            )
        reduce = self.reductions.make(reduction.name, selected, options)
        return Reduced(size, selected, reduce, self.loss_dtype, name)

    def run(
        self,
        batch: Batch,
        sink: Sink,
        *,
        trainable: Sequence[tf.Tensor] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> GradientResult:
        """`batch`'s passes fed to `sink` (in the pass itself where the sink can); its
        result (`Engine.compute` with the sink made already)."""
        in_pass = sink.in_pass
        if in_pass is None or not isinstance(sink, Reduced):
            for part in self.slices(batch, trainable):
                _stop_if(cancelled, part.start, batch.size)
                sink.add(part.start, part.losses, part.grads)
            return sink.finish()
        weights = self.weights(trainable)
        for start in range(0, batch.size, self.slice_size):
            _stop_if(cancelled, start, batch.size)
            xs, y = batch.rows(slice(start, start + self.slice_size))
            try:
                losses, outputs = self._compiled.reduced(in_pass, weights, xs, y, sink.max_norm)
            except tf.errors.InvalidArgumentError as err:
                raise InvalidArgument(f"the model refused the batch: {_first_line(err)}") from None
            sink.add_in_pass(start, losses, outputs)
        return sink.finish()
