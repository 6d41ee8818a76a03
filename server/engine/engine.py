"""Engine: per-example losses and gradients of one Keras model, usable without a server.

    engine = Engine(keras_model, loss="sparse_categorical_crossentropy")
    result = engine.per_example_gradients(x, y)   # result.gradients[name]: [B, *shape]

Layers with a closed-form rule (`rules/`) get per-example gradients from one ordinary
forward and backward pass; the rest from the vectorized route (`vectorized.py`). Work
runs in slices of examples so that TensorFlow never holds more than `slice_bytes` of
per-example tensors, and results are written once, straight into numpy buffers.

Two audiences: a user calls `per_example_gradients` and `iter_slices` (which cast and
check a batch, then compute), or `batch` once and `compute` on it; the server calls
`batch` before admission and drives the pass itself through `passes` (`passes.py`: on a
snapshot's weights, into a sink, in blocks, or as shared passes).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from pergrad.server.engine.batch import Batch, InputSpec, input_specs, make_batch
from pergrad.server.engine.blocks import SliceResult
from pergrad.server.engine.compiled import CompiledPass, JitCompile
from pergrad.server.engine.flat_call import values_reader
from pergrad.server.engine.ids import ComputedIds
from pergrad.server.engine.losses import LabelSpec, PerExampleLoss
from pergrad.server.engine.passes import Passes
from pergrad.server.engine.plan import make_plan
from pergrad.server.engine.reductions import ReductionRegistry, default_reductions
from pergrad.server.engine.rules import LayerRegistry, default_registry
from pergrad.server.engine.slices import VariableSpec
from pergrad.server.engine.vectorized import model_inputs
from pergrad.wire.results import GradientResult

_LOGGER = logging.getLogger(__name__)

DEFAULT_SLICE_BYTES = 64 << 20
# TensorFlow 2.21's oneDNN kernels segfault on vectorized_map of MultiHeadAttention at
# B >= 64 (benchmarks/engine.py, transformer_block); slices that take the vectorized
# route stay below that.
FALLBACK_MAX_SLICE = 32
# Unknown variable names an error quotes, at most.
QUOTED_NAMES = 3


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


def _slice(
    per_example: dict[str, int], slice_bytes: int, fallback: tuple[int, ...]
) -> tuple[int, str]:
    """Examples a slice holds, and why (`_slice_bound`): the bytes bound, or the
    vectorized route's cap where any variable takes that route."""
    size = max(1, slice_bytes // max(1, sum(per_example.values())))
    if fallback and size > FALLBACK_MAX_SLICE:
        return FALLBACK_MAX_SLICE, "the vectorized route's bound"
    return size, _slice_bound(per_example, slice_bytes)


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
        read_weights = values_reader(model.trainable_variables)
        self._pass = CompiledPass(
            model, self.loss, self.plan, self.label_spec, jit_compile=jit_compile
        )
        xs = tuple(np.zeros((2, *(d or 1 for d in s.shape)), s.dtype) for s in self.input_specs)
        y = np.zeros((2, *(d or 1 for d in self.label_spec.shape)), self.label_spec.dtype)
        # also refuses a scalar loss
        self.routes = _routes(self, _unreached(model, self.loss, xs, y))
        weights = tuple(read_weights())
        per_example = self._tensorflow_bytes(weights, xs, y)
        self.slice_size, self._slice_bound = _slice(per_example, slice_bytes, self.plan.fallback)
        self._pass.slice_cap = self.slice_size
        self._pass.choose(weights, *self._pass.probe_batch(xs, y))
        self.passes = Passes(
            model.name,
            self.variables,
            self._pass,
            read_weights,
            slice_size=self.slice_size,
            reductions=reductions or default_reductions(),
            loss_dtype=self.loss_dtype,
        )
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
        (for factored gradients, their factors). Runs the pass once on two zero examples,
        which also keeps tracing out of the first request's latency."""
        _, grads = self._pass(weights, xs, y)
        return {name: sum(t[0].nbytes for t in tf.nest.flatten(g)) for name, g in grads.items()}

    def batch(self, x: Any, y: Any, *, cast_dtypes: bool = True) -> Batch:
        """(x, y) cast to the model's dtypes (unless `cast_dtypes=False`: then they must
        be exactly those) and checked: a batch the model can take."""
        batch = make_batch(x, y, self.input_specs, self.label_spec, cast_dtypes=cast_dtypes)
        if self._computed_ids:
            self._computed_ids.check(batch)
        return batch

    def per_example_gradients(self, x: Any, y: Any, **kwargs: Any) -> GradientResult:
        """`compute` on the batch (x, y), cast and checked here (float64 -> float32,
        int64 -> int32 where nothing is lost)."""
        return self.compute(self.batch(x, y), **kwargs)

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
        sink = self.passes.sink(batch.size, **request)
        return self.passes.run(batch, sink, trainable=trainable, cancelled=cancelled)

    def iter_slices(self, x: Any, y: Any, **kwargs: Any) -> Iterator[SliceResult]:
        """Full per-example gradients of the batch (x, y), cast and checked here, in
        blocks as they are computed (`Passes.blocks`: `variables`, `trainable`, ...)."""
        return self.passes.blocks(self.batch(x, y), **kwargs)
