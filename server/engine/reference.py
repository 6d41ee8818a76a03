"""Slow, obviously-correct references the fast routes are checked and measured against.

`batch_size_one_loop` is the oracle: B ordinary backward passes of one example each.
`mean_gradient` is what plain training pays: one backward pass of the batch loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import numpy as np
import tensorflow as tf

from pergrad.server.engine.losses import PerExampleLoss
from pergrad.server.engine.vectorized import forward_loss


class References:
    """Compiled reference computations for one model and loss."""

    def __init__(self, model: keras.Model, loss: PerExampleLoss) -> None:
        @tf.function(reduce_retracing=True)
        def gradients(trainable, non_trainable, x, y):
            with tf.GradientTape() as tape:
                tape.watch(trainable)
                losses = forward_loss(model, loss, trainable, non_trainable, x, y)
                mean = tf.reduce_mean(losses)
            grads = tape.gradient(mean, trainable)
            return losses, [tf.convert_to_tensor(g) for g in grads]

        self._gradients = gradients
        self._trainable = [v.value for v in model.trainable_variables]
        self._non_trainable = [v.value for v in model.non_trainable_variables]

    def mean_gradient(
        self, x: np.ndarray, y: np.ndarray, *, trainable: Sequence[tf.Tensor] | None = None
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """(losses [B], gradient of the mean loss per variable)."""
        weights = self._trainable if trainable is None else list(trainable)
        losses, grads = self._gradients(weights, self._non_trainable, x, y)
        return losses.numpy(), [g.numpy() for g in grads]

    def batch_size_one_loop(
        self, x: np.ndarray, y: np.ndarray, *, trainable: Sequence[tf.Tensor] | None = None
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """(losses [B], per-example gradients [B, *shape] per variable), one example at a time."""
        per_example = [
            self.mean_gradient(x[i : i + 1], y[i : i + 1], trainable=trainable)
            for i in range(len(x))
        ]
        losses = np.concatenate([losses for losses, _ in per_example])
        grads = [np.stack(g) for g in zip(*(grads for _, grads in per_example), strict=True)]
        return losses, grads
