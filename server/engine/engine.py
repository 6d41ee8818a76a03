"""Engine: per-example losses and gradients of one Keras model, usable without a server.

    engine = Engine(keras_model, loss="sparse_categorical_crossentropy")
    result = engine.per_example_gradients(x, y)   # result.gradients[name]: [B, *shape]

Work runs in slices of examples so peak memory stays near one slice's gradients plus
the result, and so a server can send slice k while computing slice k+1.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from pergrad.client import GradientResult
from pergrad.server.engine.losses import LabelSpec, PerExampleLoss, check_labels
from pergrad.server.engine.vectorized import vectorized_per_example
from pergrad.server.errors import InvalidArgument

_LOGGER = logging.getLogger(__name__)

DEFAULT_SLICE_BYTES = 64 << 20


@dataclass(frozen=True)
class VariableSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class InputSpec:
    """Per-example input: dtype and shape without the batch; None is any size."""

    dtype: np.dtype
    shape: tuple[int | None, ...]


@dataclass(frozen=True)
class SliceResult:
    """Examples [start, stop) of a batch: losses [n] and one [n, *shape] per variable."""

    start: int
    stop: int
    losses: np.ndarray
    gradients: list[np.ndarray]


def _single(tensors: Sequence[Any], what: str, model: keras.Model) -> Any:
    if len(tensors) != 1:
        raise ValueError(f"model {model.name!r} has {len(tensors)} {what}s; pergrad needs one")
    return tensors[0]


def _variable_specs(model: keras.Model) -> tuple[VariableSpec, ...]:
    specs = tuple(
        VariableSpec(v.path, np.dtype(v.dtype), tuple(int(d) for d in v.shape))
        for v in model.trainable_variables
    )
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"model {model.name!r} has duplicate variable paths: {names}")
    if not specs:
        raise ValueError(f"model {model.name!r} has no trainable variables")
    return specs


class Engine:
    """Per-example gradients of `model` under `loss` (default: the model's compiled loss).

    Args:
        model: a built Keras 3 model with one input and one output.
        loss: a Keras loss object, name or config; the per-example loss is it unreduced.
        slice_bytes: gradient bytes computed at once; bounds peak memory.
    """

    def __init__(
        self, model: keras.Model, *, loss: Any = None, slice_bytes: int = DEFAULT_SLICE_BYTES
    ) -> None:
        loss = loss if loss is not None else getattr(model, "loss", None)
        if loss is None:
            raise ValueError(f"model {model.name!r} has no compiled loss; pass loss=")
        self.model = model
        self.loss = PerExampleLoss(loss)
        model_input = _single(model.inputs, "input", model)
        model_output = _single(model.outputs, "output", model)
        self.input_spec = InputSpec(np.dtype(model_input.dtype), tuple(model_input.shape[1:]))
        self.label_spec: LabelSpec = self.loss.label_spec(
            tuple(model_output.shape), model_output.dtype
        )
        self.variables = _variable_specs(model)
        self.loss_dtype = np.dtype(model_output.dtype)
        self.num_parameters = sum(int(np.prod(v.shape)) for v in self.variables)
        bytes_per_example = sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in self.variables)
        self.slice_size = max(1, slice_bytes // bytes_per_example)
        self._per_example = vectorized_per_example(model, self.loss)
        self._non_trainable = tuple(v.value for v in model.non_trainable_variables)
        _LOGGER.info(
            "model %s: %d variables, %d parameters, route vectorized_map, slices of %d examples",
            model.name,
            len(self.variables),
            self.num_parameters,
            self.slice_size,
        )

    def initial_weights(self) -> tuple[tf.Tensor, ...]:
        """The model's own trainable values, as immutable tensors."""
        return tuple(tf.identity(v.value) for v in self.model.trainable_variables)

    def check_batch(self, x: np.ndarray, y: np.ndarray) -> None:
        """Reject a batch the model cannot take, naming the field and what was expected."""
        if x.ndim == 0 or x.shape[0] == 0:
            raise InvalidArgument("inputs: empty batch; send at least one example")
        if x.dtype != self.input_spec.dtype:
            raise InvalidArgument(
                f"inputs: dtype {x.dtype.name}, model expects {self.input_spec.dtype.name}"
            )
        expected = self.input_spec.shape
        if len(x.shape) != len(expected) + 1 or any(
            want is not None and got != want
            for got, want in zip(x.shape[1:], expected, strict=False)
        ):
            want = ["B", *(("any" if d is None else d) for d in expected)]
            raise InvalidArgument(f"inputs: shape {list(x.shape)}, model expects {want}")
        if y.dtype != self.label_spec.dtype:
            raise InvalidArgument(
                f"labels: dtype {y.dtype.name}, model expects {self.label_spec.dtype.name}"
            )
        if y.shape != (x.shape[0], *self.label_spec.shape):
            raise InvalidArgument(
                f"labels: shape {list(y.shape)}, expected {[x.shape[0], *self.label_spec.shape]}"
                " (one label per input example)"
            )
        check_labels(y, self.label_spec)

    def iter_slices(
        self, x: np.ndarray, y: np.ndarray, *, trainable: Sequence[tf.Tensor] | None = None
    ) -> Iterator[SliceResult]:
        """Results slice by slice; the batch is checked at the call, before any work."""
        self.check_batch(x, y)
        weights = tuple(trainable) if trainable is not None else self.initial_weights()
        return self._slices(x, y, weights)

    def _slices(
        self, x: np.ndarray, y: np.ndarray, weights: tuple[tf.Tensor, ...]
    ) -> Iterator[SliceResult]:
        for start in range(0, x.shape[0], self.slice_size):
            stop = min(start + self.slice_size, x.shape[0])
            losses, grads = self._per_example(
                weights, self._non_trainable, x[start:stop], y[start:stop]
            )
            yield SliceResult(start, stop, losses.numpy(), [g.numpy() for g in grads])

    def per_example_gradients(
        self, x: np.ndarray, y: np.ndarray, *, trainable: Sequence[tf.Tensor] | None = None
    ) -> GradientResult:
        """Per-example losses [B] and gradients {variable: [B, *shape]} of one batch."""
        batch = x.shape[0] if x.ndim else 0
        losses = np.empty(batch, dtype=self.loss_dtype)
        grads = {v.name: np.empty((batch, *v.shape), dtype=v.dtype) for v in self.variables}
        outputs = list(grads.values())
        for part in self.iter_slices(x, y, trainable=trainable):
            losses[part.start : part.stop] = part.losses
            for out, grad in zip(outputs, part.gradients, strict=True):
                out[part.start : part.stop] = grad
        return GradientResult(losses=losses, gradients=grads, model=self.model.name)
