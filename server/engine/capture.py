"""Recording what per-layer rules need during one ordinary forward pass.

While `capture` is active, each given layer's `call` is wrapped: it runs the layer's own
code with the activation switched off to get the pre-activation output z, watches z on
the tape (so the backward pass yields dL/dz), records (inputs, z), and then applies the
activation. It is used while tracing a `tf.function`, so the wrapping costs nothing per
request; a lock keeps two traces from patching the same layers at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

_PATCH_LOCK = threading.RLock()


@dataclass(frozen=True)
class LayerCall:
    layer: keras.layers.Layer
    inputs: tf.Tensor
    outputs: tf.Tensor


def _recording(layer: keras.layers.Layer, tape: tf.GradientTape, calls: list[LayerCall]) -> Any:
    original = type(layer).call.__get__(layer)

    def call(inputs: tf.Tensor, *args: Any, **kwargs: Any) -> tf.Tensor:
        activation = getattr(layer, "activation", None)
        if activation is not None:
            layer.activation = keras.activations.linear
        try:
            z = original(inputs, *args, **kwargs)
        finally:
            if activation is not None:
                layer.activation = activation
        tape.watch(z)
        calls.append(LayerCall(layer, inputs, z))
        return activation(z) if activation is not None else z

    return call


@contextmanager
def capture(
    layers: Sequence[keras.layers.Layer], tape: tf.GradientTape
) -> Iterator[list[LayerCall]]:
    """Record every call of `layers` made inside the block, in call order."""
    calls: list[LayerCall] = []
    with _PATCH_LOCK:
        for layer in layers:
            layer.call = _recording(layer, tape, calls)
        try:
            yield calls
        finally:
            for layer in layers:
                del layer.call
