"""The generic route: per-example gradients of any Keras model by `tf.vectorized_map`.

`vectorized_map` (pfor) turns "gradient of example i's loss" into one batched graph,
with no Python loop over examples. Measured here (TF 2.21, mnist_cnn, B=256):
vectorized_map 0.14 s per batch, `GradientTape.jacobian` with pfor 5.6 s (its cost
grows with B^2), the batch-size-1 loop 1.0 s; so this route uses vectorized_map.
The weights are arguments, not the model's variables: a request computes against the
immutable snapshot it was given, whatever SetWeights does meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import keras
import tensorflow as tf

from pergrad.server.engine.losses import PerExampleLoss

PerExampleFn = Callable[
    [Sequence[tf.Tensor], Sequence[tf.Tensor], tf.Tensor, tf.Tensor],
    tuple[tf.Tensor, list[tf.Tensor]],
]


def forward_loss(
    model: keras.Model,
    loss: PerExampleLoss,
    trainable: Sequence[tf.Tensor],
    non_trainable: Sequence[tf.Tensor],
    x: tf.Tensor,
    y: tf.Tensor,
) -> tf.Tensor:
    """Per-example losses [B] of the model in inference mode with the given weights."""
    outputs, _ = model.stateless_call(list(trainable), list(non_trainable), x, training=False)
    return loss(y, outputs)


def vectorized_per_example(model: keras.Model, loss: PerExampleLoss) -> PerExampleFn:
    """(trainable, non_trainable, x, y) -> (losses [B], [grad [B, *shape] per variable])."""

    @tf.function(reduce_retracing=True)
    def per_example(trainable, non_trainable, x, y):
        def one_example(example):
            xi, yi = example
            with tf.GradientTape() as tape:
                tape.watch(trainable)
                loss_i = forward_loss(model, loss, trainable, non_trainable, xi[None], yi[None])
            return loss_i[0], tape.gradient(loss_i, trainable)

        return tf.vectorized_map(one_example, (x, y))

    return per_example
