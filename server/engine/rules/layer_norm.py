"""LayerNormalization: z = gamma * x_hat + beta, x_hat normalized over `axis`.

Per example: dgamma_b = sum over the axes gamma does not span of g_b * x_hat_b; dbeta_b
likewise of g_b. x_hat is recomputed from the input with the layer's own epsilon: (x -
mean) / sqrt(var + eps), or with `rms_scaling` x / sqrt(var + eps) and no beta, as Keras
computes it (the variance, not the mean square: `rms_norm.py` has the mean-square form).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad
from pergrad.server.engine.rules import Rule


def norm_axes(layer: keras.layers.LayerNormalization, rank: int) -> list[int]:
    axes = layer.axis if isinstance(layer.axis, list | tuple) else [layer.axis]
    return sorted(a % rank for a in axes)


def reduce_to_params(t: tf.Tensor, axes: list[int]) -> tf.Tensor:
    """[B, ...] summed over every axis but the batch and `axes` (those a scale spans)."""
    rank = len(t.shape)
    return tf.reduce_sum(t, axis=[a for a in range(1, rank) if a not in axes])


def per_example(
    layer: keras.layers.LayerNormalization, inputs: tf.Tensor, output_grad: tf.Tensor
) -> dict[str, Grad]:
    axes = norm_axes(layer, len(inputs.shape))
    x = tf.cast(inputs, output_grad.dtype)
    mean, variance = tf.nn.moments(x, axes=axes, keepdims=True)
    centered = x if layer.rms_scaling else x - mean
    x_hat = centered * tf.math.rsqrt(variance + layer.epsilon)
    grads: dict[str, Grad] = {}
    if layer.scale or layer.rms_scaling:
        grads[layer.gamma.path] = reduce_to_params(output_grad * x_hat, axes)
    if layer.center and not layer.rms_scaling:
        grads[layer.beta.path] = reduce_to_params(output_grad, axes)
    return grads


RULE = Rule(per_example)
# The layer classes (exactly these; a subclass may change the math) this rule covers.
LAYERS = (keras.layers.LayerNormalization,)
