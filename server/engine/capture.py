"""Recording what per-layer rules need during one ordinary forward pass.

While `capture` is active, each given layer's `call` is wrapped: by default it runs the
layer's own code with the activation switched off to get the pre-activation output z,
watches z on the tape (so the backward pass yields dL/dz), records (inputs, z), and then
applies the activation. A rule with a `forward` of its own (recurrent layers) computes
the layer's outputs itself and says what to record and watch. It is used while tracing a
`tf.function`, so the wrapping costs nothing per request; a lock keeps two traces from
patching the same layers at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

_PATCH_LOCK = threading.RLock()


@dataclass(frozen=True)
class LayerCall:
    """One call of a ruled layer: what its rule gets (`inputs`) and the watched tensors
    whose gradients it gets (`outputs`: z, or a rule's own probes)."""

    layer: keras.layers.Layer
    inputs: Any
    outputs: Any


# A rule's own forward: (layer, tape, inputs, *args, **kwargs) -> (the layer's output,
# what to record as inputs, what to watch and record as outputs).
Forward = Callable[..., tuple[Any, Any, Any]]


def _recording(
    layer: keras.layers.Layer,
    tape: tf.GradientTape,
    calls: list[LayerCall],
    forward: Forward | None,
) -> Any:
    original = type(layer).call.__get__(layer)

    def call(inputs: tf.Tensor, *args: Any, **kwargs: Any) -> Any:
        if forward is not None:
            output, recorded, watched = forward(layer, tape, inputs, *args, **kwargs)
            calls.append(LayerCall(layer, recorded, watched))
            return output
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
    layers: Sequence[tuple[keras.layers.Layer, Forward | None]], tape: tf.GradientTape
) -> Iterator[list[LayerCall]]:
    """Record every call of `layers` (each with its rule's forward, if any) made inside
    the block, in call order."""
    calls: list[LayerCall] = []
    with _PATCH_LOCK:
        for layer, forward in layers:
            layer.call = _recording(layer, tape, calls, forward)
        try:
            yield calls
        finally:
            for layer, _ in layers:
                del layer.call
