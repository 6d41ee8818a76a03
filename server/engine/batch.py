"""A batch the model can take: cast by the one casting policy, checked once, where it
enters (the service before admission, `Engine.per_example_gradients` for in-process use).

A model has one input or several; a batch holds one array per input, in the model's
input order, each with the batch as its leading dimension.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from pergrad.server.engine.losses import LabelSpec, check_labels
from pergrad.server.errors import InvalidArgument
from pergrad.wire.casting import CastError, arrays_by_input, cast


@dataclass(frozen=True)
class InputSpec:
    """One per-example input: its name, dtype and shape without the batch (None is any
    size). `ids_below`: an integer input that feeds an embedding directly must lie in
    [0, ids_below) (its input_dim; `ids_of` names the layer); 0 means no such bound."""

    name: str
    dtype: np.dtype
    shape: tuple[int | None, ...]
    ids_below: int = 0
    ids_of: str = ""


@dataclass(frozen=True)
class Batch:
    """One array [B, ...] per model input, in model order, and labels [B, ...], checked."""

    xs: tuple[np.ndarray, ...]
    y: np.ndarray

    @property
    def size(self) -> int:
        return int(self.xs[0].shape[0])

    def rows(self, part: slice) -> tuple[tuple[np.ndarray, ...], np.ndarray]:
        return tuple(x[part] for x in self.xs), self.y[part]


def input_names(model: keras.Model) -> list[str]:
    """The names of the model's inputs in model order: the keys of a dict of inputs (in
    the order Keras flattens them), else the input layers' names."""
    structure = getattr(model, "_inputs_struct", None)
    if isinstance(structure, Mapping):
        return sorted(structure)
    return [tensor.name for tensor in model.inputs]


def input_specs(model: keras.Model) -> tuple[InputSpec, ...]:
    return tuple(
        InputSpec(name, np.dtype(tensor.dtype), tuple(tensor.shape[1:]), *embedding_bound(model, i))
        for i, (name, tensor) in enumerate(zip(input_names(model), model.inputs, strict=True))
    )


def embedding_bound(model: keras.Model, position: int) -> tuple[int, str]:
    """(smallest input_dim, its layer's name) of the embeddings that model input number
    `position` feeds directly, or (0, "") when it feeds none. An id outside the table
    would fail deep in TensorFlow, or under XLA be clamped silently to another row."""
    tensor = model.inputs[position]
    bounds = [
        (layer.input_dim, layer.name)
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if isinstance(layer, keras.layers.Embedding)
        for node in layer._inbound_nodes
        if any(t is tensor for t in node.input_tensors)
    ]
    return min(bounds) if bounds else (0, "")


def make_batch(
    x: Any,
    y: Any,
    inputs: Sequence[InputSpec],
    labels: LabelSpec,
    *,
    cast_dtypes: bool = True,
) -> Batch:
    """(x, y) cast to the model's dtypes (or, with `cast_dtypes=False`, in exactly them:
    the wire contract's rule) and checked; InvalidArgument names the fault."""
    single = len(inputs) == 1
    try:
        values = arrays_by_input(x, [spec.name for spec in inputs])
    except CastError as err:
        raise InvalidArgument(str(err)) from None
    xs = [
        _input(value, spec, "inputs" if single else f"inputs[{spec.name!r}]", cast_dtypes)
        for value, spec in zip(values, inputs, strict=True)
    ]
    y = _array(y, labels.dtype, "labels", cast_dtypes)
    size = xs[0].shape[0]
    for array, spec in zip(xs, inputs, strict=True):
        if array.shape[0] != size:
            raise InvalidArgument(
                f"inputs[{spec.name!r}]: {array.shape[0]} examples, "
                f"inputs[{inputs[0].name!r}] has {size}"
            )
    if y.shape != (size, *labels.shape):
        raise InvalidArgument(
            f"labels: shape {list(y.shape)}, expected {[size, *labels.shape]}"
            " (one label per input example)"
        )
    check_labels(y, labels)
    return Batch(tuple(xs), y)


def _array(value: Any, dtype: np.dtype, what: str, cast_dtypes: bool) -> np.ndarray:
    if cast_dtypes:
        try:
            return cast(value, dtype, what=what)
        except CastError as err:
            raise InvalidArgument(str(err)) from None
    array = np.asarray(value)
    if array.dtype != dtype:
        raise InvalidArgument(f"{what}: dtype {array.dtype.name}, model expects {dtype.name}")
    return array


def _input(value: Any, spec: InputSpec, what: str, cast_dtypes: bool) -> np.ndarray:
    x = _array(value, spec.dtype, what, cast_dtypes)
    if x.ndim == 0 or x.shape[0] == 0:
        raise InvalidArgument(f"{what}: empty batch; send at least one example")
    if len(x.shape) != len(spec.shape) + 1 or any(
        want is not None and got != want for got, want in zip(x.shape[1:], spec.shape, strict=False)
    ):
        want = ["B", *(("any" if d is None else d) for d in spec.shape)]
        raise InvalidArgument(f"{what}: shape {list(x.shape)}, model expects {want}")
    if spec.ids_below and x.size:
        outside = (x < 0) | (x >= spec.ids_below)
        if outside.any():
            bad = np.flatnonzero(outside.reshape(len(x), -1).any(axis=1))
            raise InvalidArgument(
                f"{what}: examples {bad[:10].tolist()} hold ids outside [0, {spec.ids_below}), "
                f"the rows of embedding {spec.ids_of!r}"
            )
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        bad = np.flatnonzero(~np.isfinite(x.reshape(len(x), -1)).all(axis=1))
        raise InvalidArgument(
            f"{what}: examples {bad[:10].tolist()} hold NaN or infinity; their gradients "
            "would be NaN too: drop or fix them"
        )
    return x
