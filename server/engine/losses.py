"""Per-example losses: any Keras loss, unreduced, one value per example.

A Keras loss reduces over the batch; pergrad needs `loss_i` for each example i so that
the batch loss is their mean. For a `keras.losses.Loss` object (built-in or a subclass
of the user's) that is its `call`, which returns the values before `__call__` reduces
them; a plain function `fn(y_true, y_pred)` (a Keras loss function or the user's own) is
called as it is. Axes beyond the batch (time steps, a multi-label loss's labels when the
function keeps them) are averaged, as Keras' own mean over all values does, leaving out
steps a mask excludes (the model's output mask, or the loss's own: ignore_class). A loss that
returns one value for the whole batch cannot be split per example and is refused.

Labels: class indices [B, *] (int32) for sparse categorical crossentropy, else labels
shaped like the model's output, in its dtype (one-hot crossentropy, binary and
multi-label crossentropy, MSE, MAE, Huber, a custom function).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend import get_keras_mask

from pergrad.server.errors import InvalidArgument

_CLASS_INDEX_LOSSES = {"SparseCategoricalCrossentropy", "sparse_categorical_crossentropy"}


@dataclass(frozen=True)
class LabelSpec:
    """What labels a loss needs: dtype, shape without the batch, and the class count."""

    dtype: np.dtype
    shape: tuple[int | None, ...]  # None: an axis of any size (a causal LM's steps)
    num_classes: int


def _function(loss: Any) -> tuple[Any, str, dict[str, Any]]:
    """(per-example function, its name, the options that change its value)."""
    resolved = keras.losses.get(loss) if isinstance(loss, str | dict) else loss
    if isinstance(resolved, keras.losses.Loss):
        try:
            config = resolved.get_config()
        except NotImplementedError:
            config = {}
        options = {k: v for k, v in config.items() if k == "from_logits"}

        def unreduced(y_true: tf.Tensor, y_pred: tf.Tensor) -> tf.Tensor:
            """`resolved(y_true, y_pred)` as Loss.__call__ computes it, without reducing."""
            dtype = resolved.dtype
            y_true = keras.ops.convert_to_tensor(y_true, dtype=dtype)
            return resolved.call(y_true, keras.ops.convert_to_tensor(y_pred, dtype=dtype))

        return unreduced, type(resolved).__name__, options
    if resolved is None or not callable(resolved):
        raise ValueError(
            f"not a loss pergrad can use: {loss!r}; give a Keras loss (object, name or "
            "config) or a function of (y_true, y_pred) returning one value per example"
        )
    return resolved, getattr(resolved, "__name__", type(resolved).__name__), {}


class PerExampleLoss:
    """Wraps a Keras loss (object, name, config or function) to return a [B] vector."""

    def __init__(self, loss: Any) -> None:
        if isinstance(loss, list | tuple) or (isinstance(loss, dict) and "class_name" not in loss):
            raise ValueError("a loss per output: pergrad serves models of one output and loss")
        self._fn, self._kind, options = _function(loss)
        args = ", ".join(f"{k}={v}" for k, v in options.items())
        self.description = f"{self._kind}({args})"

    @property
    def uses_class_indices(self) -> bool:
        return self._kind in _CLASS_INDEX_LOSSES

    def label_spec(self, output_shape: tuple[int | None, ...], output_dtype: str) -> LabelSpec:
        """Labels for a model whose output is [B, *output_shape[1:]]; an axis of any size
        (a causal LM's time steps) stays None. The classes, a class-index loss's last axis,
        must have a size."""
        per_example = tuple(None if d is None else int(d) for d in output_shape[1:])
        if not self.uses_class_indices:
            return LabelSpec(np.dtype(output_dtype), per_example, 0)
        classes = per_example[-1] if per_example else None
        if classes is None:
            raise ValueError(
                f"the model's output {list(output_shape)} has classes of no fixed number; "
                f"loss {self.description} needs them"
            )
        return LabelSpec(np.dtype("int32"), per_example[:-1], classes)

    def __call__(self, labels: tf.Tensor, outputs: tf.Tensor) -> tf.Tensor:
        in_mask = get_keras_mask(outputs)
        values = self._fn(labels, outputs)
        rank = len(values.shape)
        if rank == 0:
            raise ValueError(
                f"loss {self.description} returns one value for the whole batch; pergrad "
                "needs one per example: return the values before averaging over the batch"
            )
        mask = _both(in_mask, get_keras_mask(values))
        axes = list(range(1, rank))
        if mask is None:
            return tf.reduce_mean(values, axis=axes) if axes else values
        # As Keras' Loss.__call__ on one example: the mean over its steps not masked
        # (a mask from the model's output, or the loss's own, e.g. ignore_class).
        kept = tf.broadcast_to(tf.cast(mask, values.dtype), tf.shape(values))
        total = tf.reduce_sum(values * kept, axis=axes) if axes else values * kept
        count = tf.reduce_sum(kept, axis=axes) if axes else kept
        return total / (count + keras.backend.epsilon())


def _both(first: Any, second: Any) -> Any:
    if first is None or second is None:
        return second if first is None else first
    return tf.logical_and(tf.cast(first, tf.bool), tf.cast(second, tf.bool))


def check_labels(labels: np.ndarray, spec: LabelSpec) -> None:
    """Class indices must lie in [0, num_classes): TensorFlow would give NaN or fail late."""
    if spec.num_classes and labels.size:
        low, high = int(labels.min()), int(labels.max())
        if low < 0 or high >= spec.num_classes:
            bad = low if low < 0 else high
            raise InvalidArgument(f"labels: class index {bad} out of range [0, {spec.num_classes})")
