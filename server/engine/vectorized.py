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

# Outside XLA, TensorFlow 2.21's pfor corrupts the heap in oneDNN's BatchMatMul on these
# layers' batched matmuls (tests/zoo.py: transformer families with jit_compile off).
_ATTENTION = (
    keras.layers.MultiHeadAttention,
    keras.layers.Attention,
    keras.layers.AdditiveAttention,
    keras.layers.GroupQueryAttention,
)


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

    The trainable weights are arguments, not the model's variables: a request computes
    against the immutable snapshot it was given, whatever SetWeights does meanwhile. The
    non-trainable values are the model's own, read once as the pass starts.
    """
    inputs = model_inputs(model, xs)
    outputs, _ = model.stateless_call(list(trainable), list(non_trainable), inputs, training=False)
    return loss(y, outputs)


def pfor_safe(model: keras.Model) -> bool:
    """Whether pfor outside XLA computes this model: not with attention (heap corruption),
    nor with one recurrent loop feeding another (TypeError taking the gradient). The
    loop that replaces it is correct everywhere and 2-4x slower (mnist_cnn B=256:
    126 ms vs 59 ms)."""
    layers = model._flatten_layers(include_self=False, recursive=True)
    recurrent = 0
    for layer in layers:
        if isinstance(layer, _ATTENTION):
            return False
        recurrent += isinstance(layer, keras.layers.RNN)
    return recurrent < 2


def vectorized_gradients(
    model: keras.Model,
    loss: PerExampleLoss,
    trainable: Sequence[tf.Tensor],
    non_trainable: Sequence[tf.Tensor],
    xs: Sequence[tf.Tensor],
    y: tf.Tensor,
    positions: Sequence[int],
    *,
    vectorize: bool = True,
) -> tuple[tf.Tensor, list[tf.Tensor]]:
    """(losses [B], per-example gradients [B, *shape] of trainable[i] for i in positions).

    Call it inside a `tf.function`. With `vectorize` the examples run as one batched graph
    (pfor); without it, one after the other in the graph (`tf.map_fn`), for the models
    pfor gets wrong outside XLA (`pfor_safe`).
    """
    trainable = list(trainable)

    def one_example(example: tuple[tuple[tf.Tensor, ...], tf.Tensor]) -> tuple[tf.Tensor, list]:
        xsi, yi = example
        sources = [trainable[i] for i in positions]
        with tf.GradientTape() as tape:
            tape.watch(sources)
            one = [xi[None] for xi in xsi]
            loss_i = forward_loss(model, loss, trainable, non_trainable, one, yi[None])
        # A variable the loss never reaches (a causal LM's output table under a classifier
        # head) has zero gradients, as on the rule route.
        zero = tf.UnconnectedGradients.ZERO
        return loss_i[0], tape.gradient(loss_i, sources, unconnected_gradients=zero)

    if vectorize:
        return tf.vectorized_map(one_example, (tuple(xs), y))
    loss_dtype = tf.as_dtype(model.outputs[0].dtype)

    def one_example_typed(example: tuple[tuple[tf.Tensor, ...], tf.Tensor]) -> tuple:
        loss_i, grads = one_example(example)
        return tf.cast(loss_i, loss_dtype), grads

    signature = (loss_dtype, [trainable[i].dtype for i in positions])
    return tf.map_fn(one_example_typed, (tuple(xs), y), fn_output_signature=signature)
