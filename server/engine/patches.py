"""A convolution's input unfolded into receptive fields (patches), [B, H_out, W_out,
kh*kw*C] laid out like the kernel's first axes, by the cheapest of three ways that give
the same bits:

- by slices, where each window is a whole number of strides (every stride-1 kernel;
  4x4 at stride 2): the padded input reshaped so that a stride's rows, and a stride's
  columns times the channels, are axes of their own, then one unit-stride slice per
  kernel row and column group, concatenated. A copy of the patches and no arithmetic,
  while each slice's rows hold at least _SLICE_MIN_WIDTH values;
- by a convolution with an identity filter (N*K*K multiply-adds), while K is small;
- by `tf.image.extract_patches` (~3.5 ns an output element here) otherwise.

Ad hoc timings of each way in a tf.function, medians of 15 here (B=256 unless said; ms,
each way then the one chosen; the whole passes' figures are in benchmarks/README's
reductions.py section): mnist_cnn's
conv2 (4x4 / 2 over 16 channels) 1.8-3.2 by extract_patches, 1.0-1.1 by slices; a 3x3
same conv over 16 channels, B=64 at 32x32, 13.8-16.4 by the identity filter, 5.4-5.8 by
slices; over 64 channels at 56x56, B=32, 52-53 by extract_patches, 28-31 by slices.
Slices of narrow rows lose: mnist_cnn's conv1 (8x8 / 2 over 1 channel, rows of 2) 2.8-3.0
by the identity filter, 4.0-4.2 by slices; 3x3 over 3 channels 1.2-2.1 against 2.3-3.0;
rows of 8 break even (4x4 / 2 over 4 channels: 1.00-1.02 against 1.04-1.05).

The price of slices is memory: the parts and their concatenation are alive at once, so
a layer's patches take up to twice their size while they are made (the 3x3 conv over 64
channels at 56x56, B=32, 220 MB of patches: a process's peak RSS 1,179 MB by slices
against 961 by extract_patches). Summing Gram matrices and kernels over the parts would
avoid the concatenation.
"""

from __future__ import annotations

import keras
import tensorflow as tf

# Unfolding by convolution with an identity filter costs about N*K*K multiply-adds at
# ~55 GMAC/s here, `tf.image.extract_patches` about 3.5 ns per output element (N*K); for
# mnist_cnn's conv1 (K=64) 3.6 ms vs 18 ms, for its conv2 (K=256) 7.8 ms vs 4.4 ms.
_IDENTITY_FILTER_MAX_K = 192
# Values a slice copies at a time (a stride's columns times the channels) at least, for
# slices to beat the other ways (the module's figures, in float32).
_SLICE_MIN_WIDTH = 8

Pair = tuple[int, int]


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
    if _slices_pay(inputs.shape, sizes, strides, rates):
        return _by_slices(inputs, sizes, strides, padding)
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


def _slices_pay(shape: tf.TensorShape, sizes: Pair, strides: Pair, rates: Pair) -> bool:
    """Whether `_by_slices` can unfold this input (known height and width, undilated
    windows a whole number of strides) and beats the other ways (wide enough rows)."""
    _, height, width, channels = shape
    return (
        height is not None
        and width is not None
        and rates == (1, 1)
        and all(size % stride == 0 for size, stride in zip(sizes, strides, strict=True))
        and strides[1] * channels >= _SLICE_MIN_WIDTH
    )


def _by_slices(inputs: tf.Tensor, sizes: Pair, strides: Pair, padding: str) -> tf.Tensor:
    """Patches as unit-stride slices: with x padded to (out - 1 + size / stride) strides
    on each axis and reshaped to [B, rows / sh, sh, columns / sw, sw * C], kernel row
    a * sh + r and kernel columns b * sw .. b * sw + sw - 1 of every window are
    x[:, a : a + H_out, r, b : b + W_out], concatenated in the kernel's order."""
    (kh, kw), (sh, sw) = sizes, strides
    _, height, width, channels = inputs.shape
    (out_h, before_h), (out_w, before_w) = (
        _output_and_padding(height, kh, sh, padding),
        _output_and_padding(width, kw, sw, padding),
    )
    need_h, need_w = (out_h - 1) * sh + kh, (out_w - 1) * sw + kw
    after_h, after_w = max(need_h - height - before_h, 0), max(need_w - width - before_w, 0)
    if before_h or after_h or before_w or after_w:
        inputs = tf.pad(inputs, [[0, 0], [before_h, after_h], [before_w, after_w], [0, 0]])
    rows = tf.reshape(
        inputs[:, :need_h, :need_w], [-1, need_h // sh, sh, need_w // sw, sw * channels]
    )
    parts = [
        rows[:, a : a + out_h, r, b : b + out_w]
        for a in range(kh // sh)
        for r in range(sh)
        for b in range(kw // sw)
    ]
    return tf.concat(parts, -1)


def _output_and_padding(length: int, size: int, stride: int, padding: str) -> Pair:
    """An axis's output length and the zeros before it, as TensorFlow pads ("SAME": the
    smaller half before)."""
    if padding == "VALID":
        return (length - size) // stride + 1, 0
    out = -(-length // stride)
    return out, max((out - 1) * stride + size - length, 0) // 2
