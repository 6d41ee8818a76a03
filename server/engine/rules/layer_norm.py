"""LayerNormalization: z = gamma * x_hat + beta, x_hat normalized over `axis`.

Per example: dgamma_b = sum over the axes gamma does not span of g_b * x_hat_b; dbeta_b
likewise of g_b. x_hat is recomputed from the input with the layer's own epsilon.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad
from pergrad.server.engine.rules import Rule


def _axes(layer: keras.layers.LayerNormalization, rank: int) -> list[int]:
    axes = layer.axis if isinstance(layer.axis, list | tuple) else [layer.axis]
    return sorted(a % rank for a in axes)


def _applies(layer: keras.layers.LayerNormalization) -> str | None:
    if getattr(layer, "rms_scaling", False):
        return "RMS-scaled LayerNormalization"
    return None


def _reduce_to_params(t: tf.Tensor, axes: list[int]) -> tf.Tensor:
    rank = len(t.shape)
    return tf.reduce_sum(t, axis=[a for a in range(1, rank) if a not in axes])


def per_example(
    layer: keras.layers.LayerNormalization, inputs: tf.Tensor, output_grad: tf.Tensor
) -> dict[str, Grad]:
    axes = _axes(layer, len(inputs.shape))
    x = tf.cast(inputs, output_grad.dtype)
    mean, variance = tf.nn.moments(x, axes=axes, keepdims=True)
    x_hat = (x - mean) * tf.math.rsqrt(variance + layer.epsilon)
    grads: dict[str, Grad] = {}
    if layer.scale:
        grads[layer.gamma.path] = _reduce_to_params(output_grad * x_hat, axes)
    if layer.center:
        grads[layer.beta.path] = _reduce_to_params(output_grad, axes)
    return grads


RULE = Rule(per_example, _applies)
# The layer classes (exactly these; a subclass may change the math) this rule covers.
LAYERS = (keras.layers.LayerNormalization,)
