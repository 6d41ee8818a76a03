"""Slow, obviously-correct references the fast routes are measured against.

`batch_size_one_loop`: B ordinary backward passes of one example each. `mean_gradient`:
what plain training pays, one backward pass of the batch loss. (The tests check the
engine against an oracle of their own, built from Keras alone: tests/oracle.py.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from pergrad.server.engine.losses import PerExampleLoss
from pergrad.server.engine.vectorized import forward_loss


def _as_inputs(x: Any, count: int) -> list[np.ndarray]:
    """One array per model input (a single array, a list, or a dict in model order)."""
    if isinstance(x, dict):
        return [x[name] for name in sorted(x)]
    if isinstance(x, list | tuple) and count > 1:
        return list(x)
    return [x]


class References:
    """Compiled reference computations for one model and loss."""

    def __init__(self, model: keras.Model, loss: PerExampleLoss) -> None:
        @tf.function(reduce_retracing=True)
        def gradients(
            trainable: list[tf.Tensor],
            non_trainable: list[tf.Tensor],
            xs: list[tf.Tensor],
            y: tf.Tensor,
        ) -> tuple[tf.Tensor, list[tf.Tensor]]:
            with tf.GradientTape() as tape:
                tape.watch(trainable)
                losses = forward_loss(model, loss, trainable, non_trainable, xs, y)
                mean = tf.reduce_mean(losses)
            grads = tape.gradient(mean, trainable)
            return losses, [tf.convert_to_tensor(g) for g in grads]

        self._gradients = gradients
        self._inputs = len(model.inputs)
        self._trainable = [v.value for v in model.trainable_variables]
        self._non_trainable = [v.value for v in model.non_trainable_variables]

    def mean_gradient(
        self, x: Any, y: np.ndarray, *, trainable: Sequence[tf.Tensor] | None = None
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """(losses [B], gradient of the mean loss per variable)."""
        return self._mean_gradient(_as_inputs(x, self._inputs), y, trainable)

    def _mean_gradient(
        self, xs: list[np.ndarray], y: np.ndarray, trainable: Sequence[tf.Tensor] | None
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        weights = self._trainable if trainable is None else list(trainable)
        losses, grads = self._gradients(weights, self._non_trainable, xs, y)
        return losses.numpy(), [g.numpy() for g in grads]

    def batch_size_one_loop(
        self, x: Any, y: np.ndarray, *, trainable: Sequence[tf.Tensor] | None = None
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """(losses [B], per-example gradients [B, *shape] per variable), one example at a time."""
        xs = _as_inputs(x, self._inputs)
        per_example = [
            self._mean_gradient([a[i : i + 1] for a in xs], y[i : i + 1], trainable)
            for i in range(len(y))
        ]
        losses = np.concatenate([losses for losses, _ in per_example])
        grads = [np.stack(g) for g in zip(*(grads for _, grads in per_example), strict=True)]
        return losses, grads
