"""Running the per-example pass as a compiled TensorFlow function, with or without XLA.

XLA helps some models and hurts others on this CPU (B=256: transformer_block 37 ms with
XLA vs 54 ms without; mnist_cnn 70 ms vs 21 ms), so "auto" times both on a probe batch,
in alternating rounds, and keeps XLA only when it is clearly faster (by XLA_MARGIN): a
close call goes to the plain graph, so replicas of one deployment agree on it. The
choice is made once per model, when it loads, and logged; `--jit-compile on|off` pins it.

A model with variables on the vectorized route takes XLA when it can: without it, pfor's
batched matmuls crash TensorFlow 2.21's oneDNN kernels on MultiHeadAttention, so such
models run their examples in a graph loop instead (`vectorized.pfor_safe`). When XLA
cannot compile a model (a recurrent layer's while loop: TensorListReserve), "auto" runs
it without XLA, which computes it correctly, and says so.

Two cases need a static batch size: XLA compiles once per input shape, and the
vectorized route (pfor) segfaults in TensorFlow 2.21's oneDNN kernels on
MultiHeadAttention when the batch dimension is unknown at trace time. Then slices are
padded with copies of their first example to a power-of-two bucket, one function per
bucket, and the padding is dropped from the results (and weighs nothing in sums).
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

from pergrad.server.engine.flat_call import FlatCall
from pergrad.server.engine.grads import Grad, host, rows, to_numpy
from pergrad.server.engine.in_pass import InPass
from pergrad.server.engine.losses import LabelSpec, PerExampleLoss
from pergrad.server.engine.plan import Plan
from pergrad.server.engine.ruled import per_example_function
from pergrad.server.engine.vectorized import pfor_safe

_LOGGER = logging.getLogger(__name__)

JitCompile = bool | Literal["auto"]
XLA_MARGIN = 0.85
_ROUNDS = 7
_PROBE_BATCH = 128
Inputs = tuple[np.ndarray, ...]


def bucket(count: int, cap: int) -> int:
    """The padded size for a slice of `count` examples: a power of two, at most `cap`."""
    return min(cap, 1 << (count - 1).bit_length())


class CompiledPass:
    """(weights, xs, y) -> (losses [n], {variable path: numpy Grad}) for one slice, read-only
    views of the pass's outputs (`grads.host`); xs holds one array per model input."""

    def __init__(
        self,
        model: keras.Model,
        loss: PerExampleLoss,
        plan: Plan,
        label_spec: LabelSpec,
        *,
        jit_compile: JitCompile,
    ) -> None:
        pfor = pfor_safe(model)
        self._build = lambda jit, size, in_pass: per_example_function(
            model,
            loss,
            plan,
            label_shape=label_spec.shape,
            label_dtype=tf.as_dtype(label_spec.dtype),
            jit_compile=jit,
            batch_size=size,
            vectorize=jit or pfor,
            in_pass=in_pass,
        )
        self._vectorized = bool(plan.fallback)
        self._auto = jit_compile == "auto"
        self.slice_cap = 1
        self.choice = "XLA on" if jit_compile is True else "XLA off"
        # (with XLA, without), seconds: the medians that decided, where "auto" timed both.
        self.medians: tuple[float, float] | None = None
        self._functions: dict[tuple[bool, int | None, InPass | None], FlatCall] = {}
        self._use(jit_compile is True)

    @property
    def takes_any_size(self) -> bool:
        """Whether a slice runs at its own size (one function for every size); else it is
        padded to a power of two (`bucket`), each compiled on its own."""
        return not self._static

    def _use(self, xla: bool) -> None:
        self.xla = xla
        self._static = xla or self._vectorized

    def _function(self, size: int, in_pass: InPass | None = None) -> FlatCall:
        """The compiled function for a slice of `size` examples (one for all if not
        static), returning gradients or, with `in_pass`, that reduction's outputs."""
        key = (self.xla, size if self._static else None, in_pass)
        if key not in self._functions:
            self._functions[key] = FlatCall(self._build(*key))
        return self._functions[key]

    def _padded(self, xs: Inputs, y: np.ndarray) -> tuple[Inputs, np.ndarray]:
        if not self._static:
            return xs, y
        size = bucket(y.shape[0], max(self.slice_cap, y.shape[0]))
        return tuple(_pad(x, size) for x in xs), _pad(y, size)

    def __call__(
        self, weights: Sequence[tf.Tensor], xs: Inputs, y: np.ndarray
    ) -> tuple[np.ndarray, dict[str, Grad]]:
        count = y.shape[0]
        xs, y = self._padded(xs, y)
        function = self._function(y.shape[0])
        losses, grads = function(list(weights), list(xs), y)
        kept = slice(0, count)
        return host(losses)[kept], {p: rows(to_numpy(g), kept) for p, g in grads.items()}

    def reduced(
        self,
        in_pass: InPass,
        weights: Sequence[tf.Tensor],
        xs: Inputs,
        y: np.ndarray,
        max_norm: float = 0.0,
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Losses and `in_pass`'s outputs (numpy) for one slice; padding left out."""
        count = y.shape[0]
        xs, y = self._padded(xs, y)
        function = self._function(y.shape[0], in_pass)
        real = np.zeros(y.shape[0], np.float32)
        real[:count] = 1
        losses, outputs = function(list(weights), list(xs), y, real, np.float32(max_norm))
        result: dict[str, Any] = {"squares": host(outputs["squares"])[:, :count]}
        if "sums" in outputs:
            result["sums"] = [host(t) for t in outputs["sums"]]
        return host(losses)[:count], result

    def choose(self, weights: Sequence[tf.Tensor], xs: Inputs, y: np.ndarray) -> None:
        """With jit_compile="auto": XLA where it compiles and is clearly faster (or, for
        the vectorized route, wherever it compiles); `choice` says what and why."""
        if not self._auto:
            return
        if not self._compiles(weights, xs, y):
            return
        if self._vectorized:
            self.choice = "XLA on: the model has variables on the vectorized route"
            return
        times: dict[bool, list[float]] = {False: [], True: []}
        self._use(False)
        self(weights, xs, y)  # XLA's function is traced and warm already
        for _ in range(_ROUNDS):
            for xla in (False, True):
                self._use(xla)
                times[xla].append(_seconds(self, weights, xs, y))
        with_xla, without = (statistics.median(times[k]) for k in (True, False))
        self.medians = (with_xla, without)
        self._use(with_xla < XLA_MARGIN * without)
        self.choice = (
            f"XLA {'on' if self.xla else 'off'}: {1000 * with_xla:.1f} ms with, "
            f"{1000 * without:.1f} ms without, medians of {_ROUNDS} on {y.shape[0]} examples"
        )

    def _compiles(self, weights: Sequence[tf.Tensor], xs: Inputs, y: np.ndarray) -> bool:
        """Whether XLA compiles this model (it is left in use if so); if not, the plain
        graph is used from now on and `choice` says why."""
        self._use(True)
        try:
            self(weights, xs, y)
        except (tf.errors.OpError, ValueError, TypeError) as err:
            self._use(False)
            self._functions.clear()
            reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err)
            self.choice = f"XLA off: it cannot compile this model ({reason})"
            return False
        return True

    def probe_batch(self, xs: Inputs, y: np.ndarray) -> tuple[Inputs, np.ndarray]:
        """A batch of zero examples the size of a typical slice, for `choose`."""
        size = bucket(_PROBE_BATCH, self.slice_cap)
        return tuple(_pad(x[:0], size) for x in xs), _pad(y[:0], size)


def _seconds(run: CompiledPass, weights: Sequence[tf.Tensor], xs: Inputs, y: np.ndarray) -> float:
    start = time.perf_counter()
    run(weights, xs, y)
    return time.perf_counter() - start


def _pad(array: np.ndarray, size: int) -> np.ndarray:
    """`array` grown to `size` rows by copies of its first: a zero example can make a model
    divide by zero (a mean over a padding mask of none), and its NaN would reach the sums
    its zero weight leaves it out of (0 * NaN is NaN). An empty array grows by zeros."""
    count = array.shape[0]
    if count == size:
        return array
    if count == 0:
        return np.zeros((size, *array.shape[1:]), array.dtype)
    return np.concatenate([array, np.repeat(array[:1], size - count, axis=0)])
