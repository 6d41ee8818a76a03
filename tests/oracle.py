"""An independent oracle for per-example losses and gradients, built from Keras alone.

`server/engine/reference.py` (the batch-size-1 loop the older tests compare against)
calls the engine's own `forward_loss` and `PerExampleLoss`: a mistake in how pergrad
defines or reduces a loss, calls the model or unpacks several inputs would sit on both
sides of such a comparison and cancel out. This module imports nothing from
`pergrad.server`. It takes Keras' own definition of "the loss of one example" literally:

    for each example i:
        with tf.GradientTape() as tape:
            out = model(x_i, training=False)   # x_i: that example alone, a batch of one
            value = keras_loss(y_i, out)       # Loss.__call__, its default reduction
        gradients_i = tape.gradient(value, model.trainable_variables)

A `keras.losses.Loss` object is called as Keras calls it in `fit` (its `__call__`, with
its default "sum_over_batch_size" reduction: on a batch of one, the mean over all of
that example's values, masks included); a loss name is resolved with
`keras.losses.get`; a plain function of (y_true, y_pred) gives the mean of the values
it returns, as Keras' wrapper of a compiled loss function does. The model is called
through its ordinary `__call__` on its ordinary variables (no `stateless_call`, no
`tf.function`, no vectorized_map), with x as one array, a dict of arrays by input name,
or a list of arrays in `model.inputs` order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import keras
import numpy as np
import tensorflow as tf


def _loss_function(loss: Any) -> Callable[[Any, Any], tf.Tensor]:
    """(y_true, y_pred) of one example -> its scalar loss, as Keras defines it."""
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if isinstance(loss, keras.losses.Loss):
        return loss  # __call__ with the object's own (default) reduction
    if callable(loss):

        def mean_of_values(y_true: Any, y_pred: tf.Tensor) -> tf.Tensor:
            return tf.reduce_mean(loss(y_true, y_pred))

        return mean_of_values
    raise TypeError(f"not a loss: {loss!r}")


def _example(x: Any, i: int) -> Any:
    """Example i of x (an array, a dict or a list of arrays) as a batch of one."""
    if isinstance(x, Mapping):
        return {name: np.asarray(value)[i : i + 1] for name, value in x.items()}
    if isinstance(x, list | tuple):
        return [np.asarray(value)[i : i + 1] for value in x]
    return np.asarray(x)[i : i + 1]


def _batch_size(x: Any) -> int:
    if isinstance(x, Mapping):
        return len(next(iter(x.values())))
    if isinstance(x, list | tuple):
        return len(x[0])
    return len(x)


def per_example(
    model: keras.Model, loss: Any, x: Any, y: Any
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(losses [B], {variable.path: per-example gradients [B, *shape]}) of every trainable
    variable, one example at a time; float32 as the model computes them."""
    loss_fn = _loss_function(loss)
    variables = list(model.trainable_variables)
    y = np.asarray(y)
    losses, grads = [], {v.path: [] for v in variables}
    for i in range(_batch_size(x)):
        with tf.GradientTape() as tape:
            out = model(_example(x, i), training=False)
            value = loss_fn(y[i : i + 1], out)
        gradients = tape.gradient(
            value, variables, unconnected_gradients=tf.UnconnectedGradients.ZERO
        )
        losses.append(float(value))
        for v, g in zip(variables, gradients, strict=True):
            grads[v.path].append(tf.convert_to_tensor(g).numpy())
    return np.asarray(losses, np.float32), {k: np.stack(v) for k, v in grads.items()}


def clipped_sum(grads: Mapping[str, np.ndarray], max_norm: float) -> dict[str, np.ndarray]:
    """sum_b min(1, C / ||g_b||) g_b per variable, in float64."""
    norms = per_example_norms(grads)
    scale = np.minimum(1.0, max_norm / np.maximum(norms, 1e-300))
    return {
        name: np.tensordot(scale, g.astype(np.float64), axes=(0, 0)) for name, g in grads.items()
    }


def per_example_norms(grads: Mapping[str, np.ndarray]) -> np.ndarray:
    """||g_b|| over all the given variables, in float64."""
    squares = [
        np.sum(np.square(g.astype(np.float64)).reshape(len(g), -1), axis=1) for g in grads.values()
    ]
    return np.sqrt(np.sum(squares, axis=0))
