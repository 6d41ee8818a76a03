"""Running the per-example pass as a compiled TensorFlow function, with or without XLA.

XLA helps some models and hurts others on this CPU (B=256: transformer_block 37 ms with
XLA vs 54 ms without; mnist_cnn 70 ms vs 21 ms), so "auto" times both on a probe batch
and keeps XLA only when it is clearly faster.

Two cases need a static batch size: XLA compiles once per input shape, and the
vectorized route (pfor) segfaults in TensorFlow 2.21's oneDNN kernels on
MultiHeadAttention when the batch dimension is unknown at trace time. Then slices are
padded with zero examples to a power-of-two bucket, one function per bucket, and the
padding is dropped from the results.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any, Literal

import keras
import numpy as np
import tensorflow as tf

from pergrad.server.engine.grads import Grad, rows, to_numpy
from pergrad.server.engine.losses import LabelSpec, PerExampleLoss
from pergrad.server.engine.plan import Plan
from pergrad.server.engine.ruled import per_example_function

_LOGGER = logging.getLogger(__name__)

JitCompile = bool | Literal["auto"]
_XLA_MUST_BEAT = 0.9
_PROBE_BATCH = 128


def bucket(count: int, cap: int) -> int:
    """The padded size for a slice of `count` examples: a power of two, at most `cap`."""
    return min(cap, 1 << (count - 1).bit_length())


class CompiledPass:
    """(weights, x, y) -> (losses [n], {variable path: numpy Grad}) for one slice."""

    def __init__(
        self,
        model: keras.Model,
        loss: PerExampleLoss,
        plan: Plan,
        label_spec: LabelSpec,
        *,
        jit_compile: JitCompile,
    ) -> None:
        self._build = lambda jit, size: per_example_function(
            model,
            loss,
            plan,
            label_shape=label_spec.shape,
            label_dtype=tf.as_dtype(label_spec.dtype),
            jit_compile=jit,
            batch_size=size,
        )
        self._non_trainable = [v.value for v in model.non_trainable_variables]
        self._vectorized = bool(plan.fallback)
        self._auto = jit_compile == "auto"
        self.slice_cap = 1
        self._use(jit_compile is True)

    def _use(self, xla: bool) -> None:
        self.xla = xla
        self._static = xla or self._vectorized
        self._functions: dict[int | None, Any] = {}

    def _function(self, size: int) -> Any:
        """The compiled function for a slice of `size` examples (one for all if not static)."""
        key = size if self._static else None
        if key not in self._functions:
            self._functions[key] = self._build(self.xla, key)
        return self._functions[key]

    def __call__(
        self, weights: Sequence[tf.Tensor], x: np.ndarray, y: np.ndarray
    ) -> tuple[np.ndarray, dict[str, Grad]]:
        count = x.shape[0]
        if self._static:
            size = bucket(count, max(self.slice_cap, count))
            x, y = _pad(x, size), _pad(y, size)
        losses, grads = self._function(x.shape[0])(list(weights), self._non_trainable, x, y)
        kept = slice(0, count)
        return losses.numpy()[kept], {p: rows(to_numpy(g), kept) for p, g in grads.items()}

    def choose(self, weights: Sequence[tf.Tensor], x: np.ndarray, y: np.ndarray) -> None:
        """With jit_compile="auto", keep XLA only if it beats the plain graph on (x, y).

        A model with variables on the vectorized route always takes XLA: without it,
        pfor's batched matmuls crash TensorFlow 2.21's oneDNN kernels (heap corruption
        in BatchMatMulMkl, seen on MultiHeadAttention at batch sizes from 2 to 256).
        """
        if not self._auto:
            return
        if self._vectorized:
            self._use(True)
            _LOGGER.info("XLA on: the model has variables on the vectorized route")
            return
        times = {}
        for xla in (False, True):
            self._use(xla)
            self(weights, x, y)
            times[xla] = statistics.median(_seconds(self, weights, x, y) for _ in range(3))
        self._use(times[True] < _XLA_MUST_BEAT * times[False])
        _LOGGER.info(
            "XLA %s: %.1f ms with, %.1f ms without, batch of %d",
            "on" if self.xla else "off",
            1000 * times[True],
            1000 * times[False],
            x.shape[0],
        )

    def probe_batch(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A batch of zero examples the size of a typical slice, for `choose`."""
        size = bucket(_PROBE_BATCH, self.slice_cap)
        return _pad(x[:0], size), _pad(y[:0], size)


def _seconds(
    run: CompiledPass, weights: Sequence[tf.Tensor], x: np.ndarray, y: np.ndarray
) -> float:
    start = time.perf_counter()
    run(weights, x, y)
    return time.perf_counter() - start


def _pad(array: np.ndarray, size: int) -> np.ndarray:
    if array.shape[0] == size:
        return array
    padding = np.zeros((size - array.shape[0], *array.shape[1:]), array.dtype)
    return np.concatenate([array, padding])
