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
from pergrad.server.engine.rules import Rule


def applies_to_conv(layer: keras.layers.Layer) -> str | None:
    if layer.data_format != "channels_last":
        return f"{type(layer).__name__} with data_format={layer.data_format}"
    if getattr(layer, "lora_enabled", False):
        return f"LoRA-enabled {type(layer).__name__}"
    return None


# Unfolding by convolution with an identity filter costs about N*K*K multiply-adds at
# ~55 GMAC/s here, `tf.image.extract_patches` about 3.5 ns per output element (N*K); for
# mnist_cnn's conv1 (K=64) 3.6 ms vs 18 ms, for its conv2 (K=256) 7.8 ms vs 4.4 ms.
_IDENTITY_FILTER_MAX_K = 192


def patches_2d(layer: keras.layers.Layer, inputs: tf.Tensor) -> tf.Tensor:
    """[B, H_out, W_out, kh*kw*C] receptive fields, laid out like the kernel's first axes."""
    sizes, strides, rates = (
        tuple(layer.kernel_size),
        tuple(layer.strides),
        tuple(layer.dilation_rate),
    )
    padding = layer.padding.upper()
    if len(sizes) == 1:
        if padding == "CAUSAL":
            inputs = tf.pad(inputs, [[0, 0], [rates[0] * (sizes[0] - 1), 0], [0, 0]])
            padding = "VALID"
        inputs, sizes, strides, rates = inputs[:, None], (1, *sizes), (1, *strides), (1, *rates)
    channels = inputs.shape[-1]
    k = sizes[0] * sizes[1] * channels
    if k <= _IDENTITY_FILTER_MAX_K:
        identity = tf.reshape(tf.eye(k, dtype=inputs.dtype), [*sizes, channels, k])
        return tf.nn.conv2d(inputs, identity, strides, padding, dilations=rates)
    return tf.image.extract_patches(
        inputs,
        sizes=[1, *sizes, 1],
        strides=[1, *strides, 1],
        rates=[1, *rates, 1],
        padding=padding,
    )


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
