"""A model's optimizer: applies a gradient to a weights snapshot, giving new weights and
new optimizer state, both immutable tensors.

The optimizer is Keras's own (`--optimizer`, e.g. "sgd:momentum=0.9" or "adam"). Its
variables, and shadow copies of the model's, are only scratch space: a step loads the
snapshot's weights and optimizer state into them, applies the gradient in one function
compiled by XLA and reads the results out as new tensors, with each variable's distance
moved, whether all came out finite, and the gradient's norm. The truth stays in the
`WeightsStore`'s snapshots, so a step that fails or is refused changes nothing, and a
SetWeights, whose snapshot holds no optimizer state, starts the state afresh.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf

from pergrad.server.config import ConfigError
from pergrad.server.engine.flat_call import FlatCall
from pergrad.server.errors import Cancelled
from pergrad.server.optimizer_spec import OptimizerSpec

_TURN_POLL_S = 0.1  # how often a step waiting for its turn asks whether its call ended
# Settings every Keras optimizer shares that a step does not take from --optimizer: the
# learning rate is each step's own; the rest would change the update behind the
# caller's back (gradient clipping, EMA, accumulation), so they are refused.
_NOT_SETTABLE = frozenset(
    {
        "name",
        "learning_rate",
        "clipnorm",
        "clipvalue",
        "global_clipnorm",
        "use_ema",
        "ema_momentum",
        "ema_overwrite_frequency",
        "loss_scale_factor",
        "gradient_accumulation_steps",
    }
)


def keras_optimizers() -> dict[str, type]:
    """Every optimizer class Keras exports, by its lower-case name (`keras.optimizers.get`
    knows only some: not Lamb)."""
    base = keras.optimizers.Optimizer
    return {
        name.lower(): kind
        for name, kind in vars(keras.optimizers).items()
        if isinstance(kind, type) and issubclass(kind, base) and kind is not base
    }


# The Keras whose optimizer classes a step applies (ModelInfo.keras_version): their
# arithmetic (Adam's bias correction and epsilon, for one) is that version's.
KERAS_VERSION = keras.__version__

# Optimizers a flag cannot configure: a map of optimizers, or a scaling wrapper.
NOT_FROM_A_FLAG = frozenset({"multioptimizer", "lossscaleoptimizer"})


def make_optimizer(spec: OptimizerSpec) -> keras.optimizers.Optimizer:
    """Keras's optimizer of that name with those settings; ConfigError names a bad one."""
    known = keras_optimizers()
    kind = known.get(spec.name.replace("_", ""))
    if kind is None or spec.name.replace("_", "") in NOT_FROM_A_FLAG:
        choices = sorted(set(known) - NOT_FROM_A_FLAG)
        raise ConfigError(
            f"--optimizer {spec.text!r}: {spec.name!r} is not a Keras optimizer a flag can "
            f"configure; choose one of {choices}"
        )
    optimizer = kind()
    settable = set(optimizer.get_config()) - _NOT_SETTABLE
    unknown = sorted({key for key, _ in spec.options} - settable)
    if unknown:
        raise ConfigError(
            f"--optimizer {spec.text!r}: {type(optimizer).__name__} takes no {unknown}; "
            f"it takes {sorted(settable)}"
        )
    try:
        return kind(**dict(spec.options))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"--optimizer {spec.text!r}: {err}") from None


def describe(optimizer: keras.optimizers.Optimizer) -> str:
    """Its class and the settings that change its update, as ModelInfo.optimizer says."""
    config = optimizer.get_config()
    settings = ", ".join(
        f"{key}={value}"
        for key, value in config.items()
        if key not in _NOT_SETTABLE and value is not None
    )
    return f"{type(optimizer).__name__}({settings})"


def _spec(value: keras.Variable | float) -> tf.TensorSpec:
    if isinstance(value, float):
        return tf.TensorSpec([], tf.float32)
    return tf.TensorSpec(value.shape, value.dtype)


def _all_finite(t: tf.Tensor) -> tf.Tensor:
    if not t.dtype.is_floating:
        return tf.constant(True)
    return tf.reduce_all(tf.math.is_finite(t))


def _copy(variable: keras.Variable) -> tf.Tensor:
    """The variable's value in a buffer of its own: a plain read may share the variable's,
    which a later assign could then overwrite under a state already made current."""
    return tf.raw_ops.DeepCopy(x=variable.value)


@dataclass(frozen=True)
class Stepped:
    """What one step made: the new weights, the optimizer's new state, and how far each
    variable moved (||new - old||, float32, model order)."""

    weights: tuple[tf.Tensor, ...]
    state: tuple[tf.Tensor, ...]
    moved: tuple[float, ...] = ()
    finite: tuple[bool, ...] = ()  # each new weight's values, then the state's, all finite
    gradient_norm: float = 0.0  # ||gradient|| over every variable, as applied


class Trainer:
    """One model's optimizer over shadow variables; `apply` is pure for its caller. The
    variables are made at the first step: a model nobody trains holds no second copy of
    its weights, nor optimizer slots."""

    def __init__(self, model: keras.Model, spec: OptimizerSpec) -> None:
        self._model = model
        self._spec = spec
        self._optimizer = make_optimizer(spec)
        self.description = describe(self._optimizer)
        self._turns = threading.Lock()
        self._shadows: list[keras.Variable] = []
        self._step: FlatCall | None = None

    @contextmanager
    def turn(self, cancelled: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """A whole step (gradient, update, commit) of this model, one at a time: each
        starts from the weights the last one left, and only a step in its turn uses the
        scratch variables. A caller that goes away while waiting leaves the queue."""
        while not self._turns.acquire(timeout=_TURN_POLL_S):
            if cancelled():
                raise Cancelled("the call was cancelled waiting for its turn; nothing applied")
        try:
            yield
        finally:
            self._turns.release()

    def _build(self) -> FlatCall:
        # Zeros, not the model's values: a variable made from another may share its
        # buffer, which the optimizer's in-place updates would then change under it.
        self._shadows = [
            keras.Variable(tf.zeros(v.shape, v.dtype), name=v.name)
            for v in self._model.trainable_variables
        ]
        self._optimizer.build(self._shadows)
        weights = [_spec(v) for v in self._shadows]
        signature = [weights, [_spec(v) for v in self._optimizer.variables], weights, _spec(1.0)]
        self._step = FlatCall(
            tf.function(self._apply, input_signature=signature, autograph=False, jit_compile=True)
        )
        return self._step

    def _fresh_state(self, weights: Sequence[tf.Tensor]) -> list[tf.Tensor]:
        """The state a new optimizer builds for these weights: some start from them
        (ScheduleFreeAdamW's z is a copy of the weights), so it is built on their values."""
        optimizer = make_optimizer(self._spec)
        optimizer.build([keras.Variable(tf.identity(w)) for w in weights])
        return [_copy(v) for v in optimizer.variables]

    def _apply(self, weights, state, gradient, learning_rate):
        """Compiled by XLA into a few fused passes over the weights (in TensorFlow's graph,
        Adam's update, the snapshot's copies in and out of the scratch variables and each
        variable's distance moved took 272 ms for GPT-2's 14.5M weights here; 147 ms so;
        every Keras optimizer compiles). XLA's outputs are buffers of their own, so they
        are read out as they are: TensorFlow's in-place kernels would need copies."""
        for variable, value in zip(self._shadows, weights, strict=True):
            variable.assign(value)
        for variable, value in zip(self._optimizer.variables, state, strict=True):
            variable.assign(value)
        # After the state, which holds the learning-rate variable too (as the last step
        # left it): this step's rate must be the one applied.
        self._optimizer.learning_rate = learning_rate
        self._optimizer.apply(gradient, self._shadows)
        new = [tf.identity(v.value) for v in self._shadows]
        state = [tf.identity(v.value) for v in self._optimizer.variables]
        moved = [tf.norm(tf.cast(n - w, tf.float32)) for n, w in zip(new, weights, strict=True)]
        finite = [_all_finite(n) for n in new]
        finite.append(tf.reduce_all([_all_finite(t) for t in state]))
        squares = [tf.reduce_sum(tf.square(tf.cast(g, tf.float32))) for g in gradient]
        return new, state, moved, finite, tf.sqrt(tf.add_n(squares))

    def apply(
        self,
        weights: Sequence[tf.Tensor],
        state: Sequence[tf.Tensor] | None,
        gradient: Sequence[tf.Tensor],
        learning_rate: float,
    ) -> Stepped:
        """The weights and state after one step from `weights` and `state` (None: fresh);
        called in the step's `turn`."""
        step = self._step or self._build()
        new_weights, new_state, moved, finite, norm = step(
            list(weights),
            list(self._fresh_state(weights) if state is None else state),
            list(gradient),
            np.float32(learning_rate),
        )
        return Stepped(
            tuple(new_weights),
            tuple(new_state),
            tuple(float(m) for m in moved),
            tuple(bool(f) for f in finite),
            float(norm),
        )
