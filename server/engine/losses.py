"""Per-example losses: any Keras loss, unreduced, one value per example.

A Keras loss reduces over the batch; pergrad needs `loss_i` for each example i so that
the batch loss is their mean. Axes beyond the batch (e.g. time steps) are averaged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from pergrad.server.errors import InvalidArgument

_CLASS_INDEX_LOSSES = {"SparseCategoricalCrossentropy", "sparse_categorical_crossentropy"}


@dataclass(frozen=True)
class LabelSpec:
    """What labels a loss needs: dtype, shape without the batch, and the class count."""

    dtype: np.dtype
    shape: tuple[int, ...]
    num_classes: int


class PerExampleLoss:
    """Wraps a Keras loss (object, name or serialized config) to return a [B] vector."""

    def __init__(self, loss: Any) -> None:
        resolved = keras.losses.get(loss) if isinstance(loss, str | dict) else loss
        if resolved is None or not callable(resolved):
            raise ValueError(f"not a Keras loss: {loss!r}")
        if isinstance(resolved, keras.losses.Loss):
            config = {**resolved.get_config(), "reduction": None}
            self._fn = type(resolved).from_config(config)
            self._kind = type(resolved).__name__
            options = {k: v for k, v in config.items() if k == "from_logits"}
        else:
            self._fn = resolved
            self._kind = resolved.__name__
            options = {}
        args = ", ".join(f"{k}={v}" for k, v in options.items())
        self.description = f"{self._kind}({args})"

    @property
    def uses_class_indices(self) -> bool:
        return self._kind in _CLASS_INDEX_LOSSES

    def label_spec(self, output_shape: tuple[int | None, ...], output_dtype: str) -> LabelSpec:
        """Labels for a model whose output is [B, *output_shape[1:]]."""
        per_example = tuple(int(d) for d in output_shape[1:])
        if self.uses_class_indices:
            return LabelSpec(np.dtype("int32"), per_example[:-1], per_example[-1])
        return LabelSpec(np.dtype(output_dtype), per_example, 0)

    def __call__(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        values = self._fn(labels, outputs)
        rank = len(values.shape)
        return tf.reduce_mean(values, axis=list(range(1, rank))) if rank > 1 else values


def check_labels(labels: np.ndarray, spec: LabelSpec) -> None:
    """Class indices must lie in [0, num_classes): TensorFlow would give NaN or fail late."""
    if spec.num_classes and labels.size:
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= spec.num_classes:
            bad = low if low < 0 else high
            raise InvalidArgument(f"labels: class index {bad} out of range [0, {spec.num_classes})")
