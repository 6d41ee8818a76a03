"""A batch the model can take: cast by the one casting policy, checked once, where it
enters (the service before admission, `Engine.per_example_gradients` for in-process use).

A model has one input or several; a batch holds one array per input, in the model's
input order, each with the batch as its leading dimension.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
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
    bounds = [(layer.input_dim, layer.name) for layer, ids in embedding_ids(model) if ids is tensor]
    return min(bounds) if bounds else (0, "")


def embedding_ids(model: keras.Model) -> Iterator[tuple[keras.layers.Embedding, Any]]:
    """Each embedding's ids as a tensor of `model`'s graph: those of the embeddings its
    layers are or hold (a table used in reverse, as an output projection, takes no ids),
    and those of the functional models called in it (a keras-hub backbone under a head),
    each seen through a model of the nested one's ids called on the tensors the outer graph
    gives it (an input of the nested model becomes the outer tensor itself)."""
    for layer in model.layers:
        if isinstance(layer, keras.Model) and hasattr(layer, "_inputs_struct"):
            yield from _nested_ids(layer)
            continue
        held = [
            e
            for e in layer._flatten_layers(include_self=True, recursive=True)
            if isinstance(e, keras.layers.Embedding)
        ]
        for embedding in held:
            for node in embedding._inbound_nodes:
                if not node.arguments.kwargs.get("reverse"):
                    yield embedding, node.input_tensors[0]
        yield from _held_ids(layer, held)


def _held_ids(
    layer: keras.layers.Layer, held: list[keras.layers.Embedding]
) -> Iterator[tuple[keras.layers.Embedding, Any]]:
    """A layer that holds one embedding, which records no calls of its own (a subclassed
    layer's sublayers do not: keras-hub's TokenAndPositionEmbedding), and takes integer
    ids first: those are its embedding's."""
    if len(held) != 1 or held[0] is layer or held[0]._inbound_nodes:
        return
    for node in layer._inbound_nodes:
        first = node.input_tensors[0] if node.input_tensors else None
        if first is not None and np.dtype(first.dtype).kind in "iu":
            yield held[0], first


def _nested_ids(nested: keras.Model) -> Iterator[tuple[keras.layers.Embedding, Any]]:
    for embedding, inner in embedding_ids(nested):
        try:
            ids_of = keras.Model(nested._inputs_struct, inner)
        except ValueError:  # not reachable from the nested model's inputs
            continue
        for node in nested._inbound_nodes:
            yield embedding, ids_of(*node.arguments.args, **node.arguments.kwargs)


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
    if len(y.shape) != len(labels.shape) + 1 or any(
        want is not None and got != want
        for got, want in zip(y.shape, (size, *labels.shape), strict=False)
    ):
        raise InvalidArgument(
            f"labels: shape {list(y.shape)}, expected "
            f"{[size, *(('any' if d is None else d) for d in labels.shape)]}"
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
