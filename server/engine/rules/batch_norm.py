"""BatchNormalization in inference mode: z = gamma * (x - mean) / sqrt(var + eps) + beta,
with the moving statistics. Per example: dgamma_b = sum over non-channel axes of
g_b * x_hat_b; dbeta_b likewise of g_b. (In training mode the batch statistics couple
the examples, and per-example gradients are not defined; pergrad always infers.)
"""

from __future__ import annotations

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad
from pergrad.server.engine.rules import Rule


def _applies(layer: keras.layers.BatchNormalization) -> str | None:
    if getattr(layer, "renorm", False):
        return "BatchNormalization with renorm"
    return None


def per_example(
    layer: keras.layers.BatchNormalization, inputs: tf.Tensor, output_grad: tf.Tensor
) -> dict[str, Grad]:
    rank = len(inputs.shape)
    axis = layer.axis % rank
    shape = [1] * rank
    shape[axis] = -1
    mean = tf.reshape(tf.cast(layer.moving_mean, output_grad.dtype), shape)
    variance = tf.reshape(tf.cast(layer.moving_variance, output_grad.dtype), shape)
    x_hat = (tf.cast(inputs, output_grad.dtype) - mean) * tf.math.rsqrt(variance + layer.epsilon)
    summed = [a for a in range(1, rank) if a != axis]
    grads: dict[str, Grad] = {}
    if layer.scale:
        grads[layer.gamma.path] = tf.reduce_sum(output_grad * x_hat, axis=summed)
    if layer.center:
        grads[layer.beta.path] = tf.reduce_sum(output_grad, axis=summed)
    return grads


RULE = Rule(per_example, _applies)
# The layer classes (exactly these; a subclass may change the math) this rule covers.
LAYERS = (keras.layers.BatchNormalization,)
