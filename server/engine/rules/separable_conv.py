"""SeparableConv1D and SeparableConv2D: a depthwise convolution (each input channel c with
its own M filters, output channel c * M + m), then a 1x1 convolution over those channels.

Per example, with p_b the unfolded input patches, u_b the depthwise output (recomputed
from p_b, one small contraction) and g_b = dL/dz at the layer's output:
- pointwise: dP_b = sum over positions of u_b (x) g_b, a Dense over the positions, so it
  stays factored (`Outer`) as a convolution's kernel does;
- depthwise: the depthwise rule on the gradient of u_b, g_b times the pointwise kernel
  transposed;
- bias: sum over positions of g_b.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad, Outer, as_sequence
from pergrad.server.engine.patches import patches_2d
from pergrad.server.engine.rules import Rule
from pergrad.server.engine.rules.conv import applies_to_conv
from pergrad.server.engine.rules.depthwise_conv import depthwise_kernel_grad


def per_example(
    layer: keras.layers.Layer, inputs: tf.Tensor, output_grad: tf.Tensor
) -> dict[str, Grad]:
    depthwise, pointwise = layer.depthwise_kernel, layer.pointwise_kernel
    *_, channels, multiplier = depthwise.shape
    patches = as_sequence(patches_2d(layer, inputs))
    batch = tf.shape(patches)[0]
    kernel = tf.cast(tf.reshape(depthwise, [-1, channels, multiplier]), patches.dtype)
    middle = tf.einsum(
        "bpkc,kcm->bpcm", tf.reshape(patches, [batch, -1, kernel.shape[0], channels]), kernel
    )
    middle = tf.reshape(middle, [batch, -1, channels * multiplier])
    g = as_sequence(output_grad)
    mixing = tf.cast(tf.reshape(pointwise, [channels * multiplier, -1]), g.dtype)
    grads: dict[str, Grad] = {
        depthwise.path: depthwise_kernel_grad(
            depthwise, patches, tf.matmul(g, mixing, transpose_b=True)
        ),
        pointwise.path: Outer(middle, g),
    }
    if layer.use_bias:
        grads[layer.bias.path] = tf.reduce_sum(g, 1)
    return grads


RULE = Rule(per_example, applies_to_conv)
# The layer classes (exactly these; a subclass may change the math) this rule covers.
LAYERS = (keras.layers.SeparableConv1D, keras.layers.SeparableConv2D)
