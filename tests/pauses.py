"""Layers that hold a pass where it stands, so that a test waits for events, not times: the
pass runs a `py_function` that calls `pause` on each batch."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import keras
import tensorflow as tf


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
