"""DepthwiseConv2D: each input channel c convolved with its own `depth_multiplier` filters.

Per example: dW_b[k, c, m] = sum over positions of p_b[k, c] * g_b[c, m], with p_b the
unfolded input patches; db_b = sum over positions of g_b.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad, as_sequence
from pergrad.server.engine.patches import patches_2d
from pergrad.server.engine.rules import Rule
from pergrad.server.engine.rules.conv import applies_to_conv


def depthwise_kernel_grad(kernel: keras.Variable, patches: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """Each example's gradient [B, *kernel.shape] of a depthwise kernel [*window, C, M],
    from its receptive fields `patches` [B, ..., prod(window) * C] and the gradient `g`
    [B, ..., C * M] of the depthwise output (channel c * M + m)."""
    *window, channels, multiplier = kernel.shape
    batch = tf.shape(patches)[0]
    patches = tf.reshape(patches, [batch, -1, math.prod(window), channels])
    g = tf.reshape(g, [batch, -1, channels, multiplier])
    return tf.reshape(tf.einsum("bpkc,bpcm->bkcm", patches, g), [-1, *kernel.shape])


def per_example(
    layer: keras.layers.DepthwiseConv2D, inputs: tf.Tensor, output_grad: tf.Tensor
) -> dict[str, Grad]:
    kernel = depthwise_kernel_grad(layer.kernel, patches_2d(layer, inputs), output_grad)
    grads: dict[str, Grad] = {layer.kernel.path: kernel}
    if layer.use_bias:
        grads[layer.bias.path] = tf.reduce_sum(as_sequence(output_grad), 1)
    return grads


RULE = Rule(per_example, applies_to_conv)
# The layer classes (exactly these; a subclass may change the math) this rule covers.
LAYERS = (keras.layers.DepthwiseConv2D,)
