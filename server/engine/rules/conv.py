"""Conv1D and Conv2D (channels last; strides, same/valid/causal padding, dilation, groups).

Per example, with the input unfolded into patches p_b [P, k*k*C_in/G] (the receptive field
of each of the P output positions): dW_b = sum over positions of p_b (x) g_b, per group;
db_b = sum over positions of g_b. (Rochette et al. 2019; Opacus `conv.py`.)

Without groups that is a Dense over the positions, so the kernel stays factored
(`Outer(patches, g)`): norms choose per layer between the Gram matrices over positions,
cost P^2 (K + C_out), and the formed kernel, cost P K C_out (mixed ghost clipping, Bu et
al. 2022), and a clipped sum is one weighted contraction. Grouped kernels are formed.
"""

from __future__ import annotations

import math

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad, Outer, as_sequence
from pergrad.server.engine.patches import patches_2d
from pergrad.server.engine.rules import Rule


def applies_to_conv(layer: keras.layers.Layer) -> str | None:
    if layer.data_format != "channels_last":
        return f"{type(layer).__name__} with data_format={layer.data_format}"
    if getattr(layer, "lora_enabled", False):
        return f"LoRA-enabled {type(layer).__name__}"
    return None


def per_example(
    layer: keras.layers.Layer, inputs: tf.Tensor, output_grad: tf.Tensor
) -> dict[str, Grad]:
    groups = layer.groups
    *window, channels_in, channels_out = layer.kernel.shape
    patches, g = as_sequence(patches_2d(layer, inputs)), as_sequence(output_grad)
    kernel: Grad
    if groups == 1:
        kernel = Outer(patches, g)
    else:
        batch = tf.shape(inputs)[0]
        patches = tf.reshape(patches, [batch, -1, math.prod(window), groups, channels_in])
        grouped = tf.reshape(g, [batch, -1, groups, channels_out // groups])
        kernel = tf.reshape(
            tf.einsum("bpkgc,bpgo->bkcgo", patches, grouped), [-1, *layer.kernel.shape]
        )
    grads: dict[str, Grad] = {layer.kernel.path: kernel}
    if layer.use_bias:
        grads[layer.bias.path] = tf.reduce_sum(g, 1)
    return grads


RULE = Rule(per_example, applies_to_conv)
# The layer classes (exactly these; a subclass may change the math) this rule covers.
LAYERS = (keras.layers.Conv1D, keras.layers.Conv2D)
