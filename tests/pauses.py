"""Layers that hold a pass where it stands, so that a test waits for events, not times: the
pass runs a `py_function` that calls `pause` on each batch."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import keras
import tensorflow as tf

from pergrad.server.main import RunningServer, start
from pergrad.server.models.registry import ModelRegistry, serve_model
from tests.helpers import loopback_config


class Pause(keras.layers.Layer):
    """The identity, which calls `pause` on each pass's batch in Python (a py_function)."""

    def pause(self, batch: tf.Tensor) -> None:
        raise NotImplementedError

    def call(self, x):
        def paused(batch):
            self.pause(batch)
            return batch

        out = tf.py_function(paused, [x], x.dtype)
        out.set_shape(x.shape)
        return out


class Gate(Pause):
    """Once closed, holds every pass until opened, releasing `entered` as each arrives: a
    pass that lasts exactly as long as the test wants, whatever the machine's load."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.opened = threading.Event()
        self.opened.set()
        self.entered = threading.Semaphore(0)

    @contextmanager
    def closed(self) -> Iterator[None]:
        """Closed for the block, open again after it whatever happens (threads waiting
        at the gate must not outlive a failed assertion)."""
        self.entered = threading.Semaphore(0)
        self.opened.clear()
        try:
            yield
        finally:
            self.opened.set()

    def pause(self, batch: tf.Tensor) -> None:
        self.entered.release()
        self.opened.wait(60)


def gated_server(**settings: object) -> tuple[Gate, RunningServer]:
    """A server (`loopback_config(**settings)`) of one small model, "gated", whose passes
    its gate can hold; servers made alike hold equal weights."""
    gate = Gate(name="gate")
    inputs = keras.Input((4,))
    init = keras.initializers.GlorotUniform(1)
    outputs = keras.layers.Dense(3, kernel_initializer=init, name="head")(gate(inputs))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    served = serve_model("gated", keras.Model(inputs, outputs), loss=loss, jit_compile=False)
    return gate, start(loopback_config(**settings), ModelRegistry([served]))
