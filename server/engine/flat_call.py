"""Calling a compiled TensorFlow function cheaply: as its one concrete function, with flat
tensors made by EagerTensor's own constructor (`FlatCall`), and a model's variables read
in one graph (`values_reader`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.framework.ops import EagerTensor


class FlatCall:
    """A tf.function of fixed input signature, called as its one concrete function with
    flat tensors. Calling the tf.function itself binds and casts every argument against
    the signature on each call: 3.3 of 3.8 ms of a norms pass of mnist_mlp at B=8 here,
    against 0.5 ms this way. Arrays become tensors by EagerTensor's own constructor, in
    half tf.constant's time. (`_call_flat` and `EagerTensor` are what
    `ConcreteFunction.__call__` and `tf.constant` run beneath their checks, the same in
    TF 2.20 and 2.21, which pyproject allows.)"""

    def __init__(self, function: Any) -> None:
        self._concrete = function.get_concrete_function()
        self._device = context.context().device_name

    def __call__(self, *args: Any) -> Any:
        flat = [
            a if isinstance(a, tf.Tensor) else EagerTensor(a, self._device, None)
            for a in tf.nest.flatten(args)
        ]
        return self._concrete._call_flat(flat, self._concrete.captured_inputs)


def values_reader(variables: Sequence[Any]) -> Callable[[], list[tf.Tensor]]:
    """The variables' values now, as immutable tensors read in one graph: read one by one
    from Python (or handed to a compiled pass as variables, each then copied through
    numpy), each cost ~0.1-0.2 ms here (`benchmarks/zoo.py`: mlp's six weights 0.8 ms of
    a call)."""
    read = FlatCall(tf.function(lambda: [tf.identity(v.value) for v in variables]))
    return lambda: list(read())
