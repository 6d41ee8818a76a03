"""Engine: per-example losses and gradients of one Keras model, usable without a server.

    engine = Engine(keras_model, loss="sparse_categorical_crossentropy")
    result = engine.per_example_gradients(x, y)   # result.gradients[name]: [B, *shape]

Layers with a closed-form rule (`rules/`) get per-example gradients from one ordinary
forward and backward pass; the rest from the vectorized route (`vectorized.py`). Work
runs in slices of examples so that TensorFlow never holds more than `slice_bytes` of
per-example tensors, and results are written once, straight into numpy buffers.

Two layers of calls: `batch` casts and checks a batch once (the service calls it before
admission), `compute` and `blocks` work on such a `Batch`; `per_example_gradients` and
`iter_slices` do both, for in-process use.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import logging
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from pergrad.server.engine.batch import Batch, InputSpec, input_specs, make_batch
from pergrad.server.engine.blocks import SliceResult, full_gradient_blocks
from pergrad.server.engine.compiled import CompiledPass, JitCompile, values_reader
from pergrad.server.engine.grads import Factored, Grad
from pergrad.server.engine.ids import ComputedIds
from pergrad.server.engine.losses import LabelSpec, PerExampleLoss
from pergrad.server.engine.plan import make_plan
from pergrad.server.engine.reductions import ReductionRegistry, default_reductions
from pergrad.server.engine.rules import LayerRegistry, default_registry
from pergrad.server.engine.sinks import FullGradients, Reduced, Sink
from pergrad.server.engine.slices import Slice, VariableSpec
from pergrad.server.engine.vectorized import model_inputs
from pergrad.server.errors import Cancelled, InvalidArgument
from pergrad.wire.catalogue import CATALOGUE, NONE, CheckedOptions, OptionError, Reduction
from pergrad.wire.results import GradientResult
from pergrad.wire.text import quoted

_LOGGER = logging.getLogger(__name__)

DEFAULT_SLICE_BYTES = 64 << 20
# TensorFlow 2.21's oneDNN kernels segfault on vectorized_map of MultiHeadAttention at
# B >= 64 (benchmarks/engine.py, transformer_block); slices that take the vectorized
# route stay below that.
FALLBACK_MAX_SLICE = 32
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


def _single(tensors: Sequence[Any], what: str, model: keras.Model) -> Any:
    if len(tensors) != 1:
        raise ValueError(f"model {model.name!r} has {len(tensors)} {what}s; pergrad needs one")
    return tensors[0]


def _variable_specs(model: keras.Model) -> tuple[VariableSpec, ...]:
    specs = tuple(
        VariableSpec(i, v.path, np.dtype(v.dtype), tuple(int(d) for d in v.shape))
        for i, v in enumerate(model.trainable_variables)
    )
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"model {model.name!r} has duplicate variable paths: {names}")
    if not specs:
        raise ValueError(f"model {model.name!r} has no trainable variables")
    return specs


# The route of a trainable variable the loss never reaches.
UNREACHED = "unreached: the loss never reaches it, so its gradients are zeros"


def _unreached(model: keras.Model, loss: PerExampleLoss, xs: tuple, y: np.ndarray) -> set[str]:
    """The trainable variables the loss does not depend on (a causal LM's output table
    under a classifier head, a pooler beside the sequence output): one eager pass."""
    with tf.GradientTape() as tape:
        losses = loss(y, model(model_inputs(model, xs), training=False))
    variables = model.trainable_variables
    grads = tape.gradient(losses, variables)
    return {v.path for v, g in zip(variables, grads, strict=True) if g is None}


def _routes(engine: Engine, unreached: set[str]) -> tuple[str, ...]:
    """Each variable's route (ModelInfo.routes): the plan's, or UNREACHED, logged."""
    if unreached:
        _LOGGER.warning(
            "model %s: the loss never reaches %s: %s",
            engine.model.name,
            sorted(unreached),
            UNREACHED,
        )
    return tuple(
        UNREACHED if v.name in unreached else route
        for v, route in zip(engine.variables, engine.plan.routes, strict=True)
    )


def _slice_bound(per_example: dict[str, int], slice_bytes: int) -> str:
    """Why a slice holds as many examples as it does: the per-example bytes against the
    bound, and the variable whose per-example tensors are the largest."""
    total = sum(per_example.values())
    if not per_example:
        return f"{slice_bytes >> 20} MiB bound"
    largest = max(per_example, key=per_example.__getitem__)
    return (
        f"{total / 2**20:.2f} MiB of per-example tensors an example against "
        f"{slice_bytes / 2**20:g} MiB; the most from {largest}: "
        f"{per_example[largest] / 2**20:.2f} MiB"
    )


def fingerprint(plan: str) -> str:
    """A short fingerprint of a plan's text (ModelInfo.plan_id)."""
    return hashlib.blake2b(plan.encode(), digest_size=6).hexdigest()


class Engine:
    """Per-example gradients of `model` under `loss` (default: the model's compiled loss).

    Args:
        model: a built Keras 3 model with one output and one input or several (a list or
            a dict of inputs: batches then give one array per input, by name or in order).
        loss: a Keras loss object, name or config; the per-example loss is it unreduced.
        registry: per-layer rules (default: `rules.default_registry()`).
        reductions: the reductions' classes (default: `reductions.default_reductions()`).
        slice_bytes: per-example tensors TensorFlow may hold at once; bounds peak memory.
        jit_compile: True or False forces XLA on or off; "auto" measures both once.
    """

    def __init__(
        self,
        model: keras.Model,
        *,
        loss: Any = None,
        registry: LayerRegistry | None = None,
        reductions: ReductionRegistry | None = None,
        slice_bytes: int = DEFAULT_SLICE_BYTES,
        jit_compile: JitCompile = "auto",
    ) -> None:
        loss = loss if loss is not None else getattr(model, "loss", None)
        if loss is None:
            raise ValueError(f"model {model.name!r} has no compiled loss; pass loss=")
        self.model = model
        self.reductions = reductions or default_reductions()
        self.loss = PerExampleLoss(loss)
        model_output = _single(model.outputs, "output", model)
        self.input_specs = input_specs(model)
        self.label_spec: LabelSpec = self.loss.label_spec(
            tuple(model_output.shape), model_output.dtype
        )
        self.variables = _variable_specs(model)
        self.loss_dtype = np.dtype(model_output.dtype)
        self.num_parameters = sum(int(np.prod(v.shape)) for v in self.variables)
        self.plan = make_plan(model, registry or default_registry())
        self._computed_ids = ComputedIds(model)
        self._read_weights = values_reader(model.trainable_variables)
        self._pass = CompiledPass(
            model, self.loss, self.plan, self.label_spec, jit_compile=jit_compile
        )
        xs = tuple(np.zeros((2, *(d or 1 for d in s.shape)), s.dtype) for s in self.input_specs)
        y = np.zeros((2, *(d or 1 for d in self.label_spec.shape)), self.label_spec.dtype)
        # also refuses a scalar loss
        self.routes = _routes(self, _unreached(model, self.loss, xs, y))
        weights = self.initial_weights()
        per_example = self._tensorflow_bytes(weights, xs, y)
        self.slice_size = max(1, slice_bytes // max(1, sum(per_example.values())))
        self._slice_bound = _slice_bound(per_example, slice_bytes)
        if self.plan.fallback and self.slice_size > FALLBACK_MAX_SLICE:
            self.slice_size = FALLBACK_MAX_SLICE
            self._slice_bound = "the vectorized route's bound"
        self._pass.slice_cap = self.slice_size
        self._pass.choose(weights, *self._pass.probe_batch(xs, y))
        _LOGGER.info("model %s: %s (plan %s)", model.name, self.summary, self.plan_id)

    @property
    def input_spec(self) -> InputSpec:
        """The first (for most models, the only) input."""
        return self.input_specs[0]

    @functools.cached_property  # fixed once the pass is chosen, at load; every result reads it
    def plan_text(self) -> str:
        """What decides this engine's bits: XLA or not, the slice size, each layer's route."""
        xla = "on" if self._pass.xla else "off"
        return (
            f"XLA {xla}; slices of {self.slice_size} examples ({self._slice_bound}); "
            f"{self.plan.describe()}"
        )

    @functools.cached_property
    def plan_id(self) -> str:
        """A short fingerprint of `plan_text`: equal on replicas that compute the same bits."""
        return fingerprint(self.plan_text)

    @property
    def takes_any_pass_size(self) -> bool:
        """Whether a pass runs at its own size, not padded to a compiled one."""
        return self._pass.takes_any_size

    @property
    def xla_medians(self) -> tuple[float, float] | None:
        """(with XLA, without), seconds: the medians that decided where jit_compile="auto"
        timed both (the summary shows them rounded); else None."""
        return self._pass.medians

    @property
    def summary(self) -> str:
        """What the engine does for this model, as the server logs it."""
        return (
            f"{len(self.variables)} variables, {self.num_parameters} parameters, slices of "
            f"{self.slice_size} examples, {self._pass.choice}; {self.plan.describe()}"
        )

    def _tensorflow_bytes(
        self, weights: Sequence[tf.Tensor], xs: tuple[np.ndarray, ...], y: np.ndarray
    ) -> dict[str, int]:
        """Each variable's bytes per example of the per-example tensors TensorFlow forms
        (for factored gradients, their factors).

        Runs the pass once on two zero examples, which also keeps tracing out of the
        first request's latency, and records in `factored` which variables' gradients
        come factored ("outer", "scatter" or "tied").
        """
        _, grads = self._pass(weights, xs, y)
        self.factored = {
            name: type(g).__name__.lower() for name, g in grads.items() if isinstance(g, Factored)
        }
        return {name: sum(t[0].nbytes for t in tf.nest.flatten(g)) for name, g in grads.items()}

    def initial_weights(self) -> tuple[tf.Tensor, ...]:
        """The model's own trainable values now, as immutable tensors (`values_reader`:
        `benchmarks/zoo.py`, mlp 1.31x vectorized_map's time read one by one, 0.97x so)."""
        return tuple(self._read_weights())

    def weights(self, trainable: Sequence[tf.Tensor] | None) -> tuple[tf.Tensor, ...]:
        """`trainable` (a snapshot's), or the model's own values."""
        return tuple(trainable) if trainable is not None else self.initial_weights()

    def batch(self, x: Any, y: Any, *, cast_dtypes: bool = True) -> Batch:
        """(x, y) cast to the model's dtypes (unless `cast_dtypes=False`: then they must
        be exactly those) and checked: a batch the model can take."""
        batch = make_batch(x, y, self.input_specs, self.label_spec, cast_dtypes=cast_dtypes)
        if self._computed_ids:
            self._computed_ids.check(batch)
        return batch

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
            losses, grads = self._pass(weights, xs, y)
        except tf.errors.InvalidArgumentError as err:
            raise InvalidArgument(f"the model refused the batch: {_first_line(err)}") from None
        return losses, [self._grad_or_zeros(grads, v, count) for v in self.variables]

    @staticmethod
    def _grad_or_zeros(grads: dict[str, Grad], variable: VariableSpec, count: int) -> Grad:
        """A ruled layer that the forward pass never called has zero gradients."""
        if variable.name in grads:
            return grads[variable.name]
        return np.zeros((count, *variable.shape), variable.dtype)

    def iter_slices(self, x: Any, y: Any, **kwargs: Any) -> Iterator[SliceResult]:
        """`blocks` of the batch (x, y), cast and checked here."""
        return self.blocks(self.batch(x, y), **kwargs)

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

    def per_example_gradients(self, x: Any, y: Any, **kwargs: Any) -> GradientResult:
        """`compute` on the batch (x, y), cast and checked here (float64 -> float32,
        int64 -> int32 where nothing is lost)."""
        return self.compute(self.batch(x, y), **kwargs)

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
        name = self.model.name
        if reduction.name == NONE:
            return FullGradients(
                size, selected, self.loss_dtype, name, out=out, wire_dtype=options["wire_dtype"]
            )
        reduce = self.reductions.make(reduction.name, selected, options)
        return Reduced(size, selected, reduce, self.loss_dtype, name)

    def compute(
        self,
        batch: Batch,
        *,
        trainable: Sequence[tf.Tensor] | None = None,
        cancelled: Callable[[], bool] | None = None,
        **request: Any,
    ) -> GradientResult:
        """Per-example losses [B] and, by `reduction`, full gradients or a reduction of them.

        reduction "none": `gradients` {variable: [B, *shape]}; `out`, a previous result
        of the same batch size, is refilled and returned (warm buffers fill about twice
        as fast as fresh ones). Other reductions take their options as keywords, as
        `pergrad.wire.catalogue` declares them: "norms"; "clipped_sum" (max_norm,
        noise_multiplier, seed); "moments"; "dot" (reference {variable: [K, *shape]});
        "project" (dim, seed, kind). `variables` restricts every mode to the named
        variables. `cancelled` is asked between slices; when it answers True the work
        stops with `Cancelled`.
        """
        sink = self.sink(batch.size, **request)
        return self.run(batch, sink, trainable=trainable, cancelled=cancelled)

    def run(
        self,
        batch: Batch,
        sink: Sink,
        *,
        trainable: Sequence[tf.Tensor] | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> GradientResult:
        """`batch`'s passes fed to `sink` (in the pass itself where the sink can); its
        result. `compute` with the sink made already."""
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
                losses, outputs = self._pass.reduced(in_pass, weights, xs, y, sink.max_norm)
            except tf.errors.InvalidArgumentError as err:
                raise InvalidArgument(f"the model refused the batch: {_first_line(err)}") from None
            sink.add_in_pass(start, losses, outputs)
        return sink.finish()
