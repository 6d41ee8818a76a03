"""Patches, whichever way `patches_2d` unfolds them, are `tf.image.extract_patches`'s bit
for bit (TensorFlow's definition of a receptive field, in the kernel's layout)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from pergrad.server.engine import patches

L = keras.layers

# (input shape without the batch, a new layer): every padding, odd and even sizes, windows that
# are and are not whole strides, rows of slices narrower and wider than _SLICE_MIN_WIDTH.
CASES = {
    "3x3_same_8_channels": ((6, 7, 8), lambda: L.Conv2D(2, 3, padding="same")),
    "3x3_valid_8_channels": ((6, 7, 8), lambda: L.Conv2D(2, 3)),
    "1x1_16_channels": ((5, 4, 16), lambda: L.Conv2D(2, 1)),
    "4x4_stride_2_same_odd": ((9, 11, 4), lambda: L.Conv2D(2, 4, strides=2, padding="same")),
    "4x4_stride_2_valid_odd": ((9, 11, 4), lambda: L.Conv2D(2, 4, strides=2)),
    "2x4_stride_1x2_same": ((7, 9, 6), lambda: L.Conv2D(2, (2, 4), strides=(1, 2), padding="same")),
    "8x8_stride_2_same_1_channel": ((28, 28, 1), lambda: L.Conv2D(2, 8, strides=2, padding="same")),
    "3x3_stride_2_same": ((9, 9, 8), lambda: L.Conv2D(2, 3, strides=2, padding="same")),
    "3x3_dilated_8_channels": ((9, 9, 8), lambda: L.Conv2D(2, 3, dilation_rate=2)),
    "3x3_same_40_channels": ((5, 5, 40), lambda: L.Conv2D(2, 3, padding="same")),
    "depthwise_3x3_same": ((6, 6, 8), lambda: L.DepthwiseConv2D(3, padding="same")),
    "conv1d_4_stride_2_same": ((11, 4), lambda: L.Conv1D(2, 4, strides=2, padding="same")),
    "conv1d_3_causal": ((10, 8), lambda: L.Conv1D(2, 3, padding="causal")),
}


def _built(case: str) -> tuple[tuple[int, ...], L.Layer]:
    shape, make = CASES[case]
    layer = make()
    layer.build((None, *shape))
    return shape, layer


def _reference(layer: L.Layer, x: tf.Tensor) -> tf.Tensor:
    """extract_patches of x, a Conv1D's as a Conv2D's of height 1 (causal: padded first)."""
    sizes, strides = list(layer.kernel_size), list(layer.strides)
    rates, padding = list(layer.dilation_rate), layer.padding.upper()
    if len(sizes) == 1:
        if padding == "CAUSAL":
            x = tf.pad(x, [[0, 0], [rates[0] * (sizes[0] - 1), 0], [0, 0]])
            padding = "VALID"
        x, sizes, strides, rates = x[:, None], [1, *sizes], [1, *strides], [1, *rates]
    return tf.image.extract_patches(
        x, [1, *sizes, 1], [1, *strides, 1], [1, *rates, 1], padding=padding
    )


@pytest.mark.parametrize("case", CASES)
def test_patches_are_extract_patches_bit_for_bit(case: str) -> None:
    shape, layer = _built(case)
    x = tf.constant(np.random.default_rng(0).normal(size=(3, *shape)), tf.float32)
    expected = _reference(layer, x).numpy()
    for unfold in (patches.patches_2d, tf.function(patches.patches_2d)):
        np.testing.assert_array_equal(unfold(layer, x).numpy(), expected)


def test_the_cases_unfold_both_by_slices_and_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    sliced = []
    by_slices = patches._by_slices
    monkeypatch.setattr(
        patches, "_by_slices", lambda *args: sliced.append(args) or by_slices(*args)
    )
    routes = []
    for case in CASES:
        shape, layer = _built(case)
        before = len(sliced)
        patches.patches_2d(layer, tf.zeros((1, *shape)))
        routes.append(len(sliced) > before)
    assert any(routes) and not all(routes)
