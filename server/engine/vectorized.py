"""The generic route: per-example gradients of any Keras model by `tf.vectorized_map`.

`vectorized_map` (pfor) turns "gradient of example i's loss" into one batched graph,
with no Python loop over examples. Measured here (TF 2.21, mnist_cnn, B=256):
vectorized_map 0.14 s per batch, `GradientTape.jacobian` with pfor 5.6 s (its cost
grows with B^2), the batch-size-1 loop 1.0 s; so this route uses vectorized_map. The
engine uses it for the variables of layers that no closed-form rule covers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from pergrad.server.engine.losses import PerExampleLoss


def model_inputs(model: keras.Model, xs: Sequence[tf.Tensor]) -> Any:
    """One tensor per model input, in model order, as the model takes them: the tensor
    itself for one input, else the model's own structure (a list, or a dict by name)."""
    if len(xs) == 1:
        return xs[0]
    return keras.tree.pack_sequence_as(model._inputs_struct, list(xs))


def forward_loss(
    model: keras.Model,
    loss: PerExampleLoss,
    trainable: Sequence[tf.Tensor],
    non_trainable: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    y: tf.Tensor,
) -> tf.Tensor:
    """Per-example losses [B] of the model in inference mode with the given weights.

    The weights are arguments, not the model's variables: a request computes against
    the immutable snapshot it was given, whatever SetWeights does meanwhile.
    """
    inputs = model_inputs(model, xs)
    outputs, _ = model.stateless_call(list(trainable), list(non_trainable), inputs, training=False)
    return loss(y, outputs)


def vectorized_gradients(
    model: keras.Model,
    loss: PerExampleLoss,
    trainable: Sequence[tf.Tensor],
    non_trainable: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    y: tf.Tensor,
    positions: Sequence[int],
) -> tuple[tf.Tensor, list[tf.Tensor]]:
    """(losses [B], per-example gradients [B, *shape] of trainable[i] for i in positions).

    Call it inside a `tf.function`.
    """
    trainable = list(trainable)

    def one_example(example: tuple[tuple[tf.Tensor, ...], tf.Tensor]) -> tuple[tf.Tensor, list]:
        xsi, yi = example
        sources = [trainable[i] for i in positions]
        with tf.GradientTape() as tape:
            tape.watch(sources)
            one = [xi[None] for xi in xsi]
            loss_i = forward_loss(model, loss, trainable, non_trainable, one, yi[None])
        return loss_i[0], tape.gradient(loss_i, sources)

    return tf.vectorized_map(one_example, (tuple(xs), y))
