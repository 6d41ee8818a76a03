"""An independent oracle for per-example losses and gradients, built from Keras alone.

`server/engine/reference.py` (the batch-size-1 loop the tests once compared against,
now the benchmarks' baseline) calls the engine's own `forward_loss` and `PerExampleLoss`:
a mistake in how pergrad defines or reduces a loss, calls the model or unpacks several
inputs would sit on both sides of such a comparison and cancel out (summing a sequence's
steps instead of averaging them did: `make mutants`). This module imports nothing from
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
or a list of arrays in `model.inputs` order. Given `weights`, the variables hold them for
the computation (assigned, then restored).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
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


@contextmanager
def _weights(model: keras.Model, weights: Mapping[str, Any] | None) -> Iterator[None]:
    """The model's trainable variables hold `weights` ({variable.path: value}, every one)
    inside the block and their own values again after it; None leaves them as they are."""
    if weights is None:
        yield
        return
    variables = model.trainable_variables
    assert sorted(weights) == sorted(v.path for v in variables), sorted(weights)
    saved = [v.numpy() for v in variables]
    try:
        for v in variables:
            v.assign(weights[v.path])
        yield
    finally:
        for v, value in zip(variables, saved, strict=True):
            v.assign(value)


def _gradients(tape: tf.GradientTape, value: tf.Tensor, model: keras.Model) -> dict[str, Any]:
    """A variable the loss never reaches (BERT's pooler under a head on the sequence) has
    zero gradients; TensorFlow's own UnconnectedGradients.ZERO fails on Keras variables."""
    variables = model.trainable_variables
    gradients = tape.gradient(value, variables)
    return {
        v.path: np.zeros(v.shape, v.dtype) if g is None else tf.convert_to_tensor(g).numpy()
        for v, g in zip(variables, gradients, strict=True)
    }


def per_example(
    model: keras.Model, loss: Any, x: Any, y: Any, *, weights: Mapping[str, Any] | None = None
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(losses [B], {variable.path: per-example gradients [B, *shape]}) of every trainable
    variable, one example at a time; float32 as the model computes them. `weights`:
    {variable.path: value} of every trainable variable, to compute with instead of its own."""
    loss_fn = _loss_function(loss)
    y = np.asarray(y)
    losses, grads = [], {v.path: [] for v in model.trainable_variables}
    with _weights(model, weights):
        for i in range(_batch_size(x)):
            with tf.GradientTape() as tape:
                value = loss_fn(y[i : i + 1], model(_example(x, i), training=False))
            losses.append(float(value))
            for path, g in _gradients(tape, value, model).items():
                grads[path].append(g)
    return np.asarray(losses, np.float32), {k: np.stack(v) for k, v in grads.items()}


def batch_gradient(model: keras.Model, loss: Any, x: Any, y: Any) -> dict[str, np.ndarray]:
    """{variable.path: gradient of Keras' loss of the whole batch}: what `fit` takes a step
    on, the mean of the per-example gradients where no mask weighs the examples."""
    with tf.GradientTape() as tape:
        value = _loss_function(loss)(np.asarray(y), model(x, training=False))
    return _gradients(tape, value, model)


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


def in_float64(build: Callable[[], tuple[keras.Model, Any]], model: keras.Model) -> keras.Model:
    """The model `build` makes, built again in float64 and holding `model`'s values.

    The reference for deep models: through ResNet50's fifty layers the float32 loop is
    itself only ~1e-5 exact (1.3e-5 from the float64 loop on one example here), as far
    from the truth as the engine may be, so the engine is held to the float64 loop."""
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("float64")
    try:
        twin, _ = build()
    finally:
        keras.config.set_dtype_policy(policy)
    for mine, theirs in zip(twin.weights, model.weights, strict=True):
        mine.assign(np.asarray(theirs.numpy(), np.float64))
    return twin
