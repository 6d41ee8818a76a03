"""DepthwiseConv2D: each input channel c convolved with its own `depth_multiplier` filters.

Per example: dW_b[k, c, m] = sum over positions of p_b[k, c] * g_b[c, m], with p_b the
unfolded input patches; db_b = sum over positions of g_b.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad
from pergrad.server.engine.rules import Rule
from pergrad.server.engine.rules.conv import applies_to_conv, patches_2d


def per_example(
    layer: keras.layers.DepthwiseConv2D, inputs: tf.Tensor, output_grad: tf.Tensor
) -> dict[str, Grad]:
    *window, channels, multiplier = layer.kernel.shape
    batch = tf.shape(inputs)[0]
    patches = tf.reshape(patches_2d(layer, inputs), [batch, -1, math.prod(window), channels])
    g = tf.reshape(output_grad, [batch, -1, channels, multiplier])
    kernel = tf.einsum("bpkc,bpcm->bkcm", patches, g)
    grads: dict[str, Grad] = {layer.kernel.path: tf.reshape(kernel, [-1, *layer.kernel.shape])}
    if layer.use_bias:
        grads[layer.bias.path] = tf.reduce_sum(
            tf.reshape(output_grad, [batch, -1, channels * multiplier]), 1
        )
    return grads


RULE = Rule(per_example, applies_to_conv)
# The layer classes (exactly these; a subclass may change the math) this rule covers.
LAYERS = (keras.layers.DepthwiseConv2D,)
