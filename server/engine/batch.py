"""A batch the model can take: cast by the one casting policy, checked once, where it
enters (the service before admission, `Engine.per_example_gradients` for in-process use).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from pergrad.server.engine.losses import LabelSpec, check_labels
from pergrad.server.errors import InvalidArgument
from pergrad.wire.casting import CastError, cast


@dataclass(frozen=True)
class InputSpec:
    """Per-example input: dtype and shape without the batch; None is any size.
    `ids_below`: integer inputs that feed an embedding directly must lie in
    [0, ids_below) (its input_dim; `ids_of` names the layer); 0 means no such bound."""

    dtype: np.dtype
    shape: tuple[int | None, ...]
    ids_below: int = 0
    ids_of: str = ""


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


@dataclass(frozen=True)
class Batch:
    """Inputs [B, ...] and labels [B, ...] that passed `make_batch`."""

    x: np.ndarray
    y: np.ndarray

    @property
    def size(self) -> int:
        return int(self.x.shape[0])


def make_batch(
    x: Any, y: Any, inputs: InputSpec, labels: LabelSpec, *, cast_dtypes: bool = True
) -> Batch:
    """(x, y) cast to the model's dtypes (or, with `cast_dtypes=False`, in exactly them:
    the wire contract's rule) and checked; InvalidArgument names the fault."""
    if cast_dtypes:
        try:
            x = cast(x, inputs.dtype, what="inputs")
            y = cast(y, labels.dtype, what="labels")
        except CastError as err:
            raise InvalidArgument(str(err)) from None
    for what, array, dtype in (("inputs", x, inputs.dtype), ("labels", y, labels.dtype)):
        if array.dtype != dtype:
            raise InvalidArgument(f"{what}: dtype {array.dtype.name}, model expects {dtype.name}")
    _check_inputs(x, inputs)
    if y.shape != (x.shape[0], *labels.shape):
        raise InvalidArgument(
            f"labels: shape {list(y.shape)}, expected {[x.shape[0], *labels.shape]}"
            " (one label per input example)"
        )
    check_labels(y, labels)
    return Batch(x, y)


def _check_inputs(x: np.ndarray, spec: InputSpec) -> None:
    if x.ndim == 0 or x.shape[0] == 0:
        raise InvalidArgument("inputs: empty batch; send at least one example")
    if len(x.shape) != len(spec.shape) + 1 or any(
        want is not None and got != want for got, want in zip(x.shape[1:], spec.shape, strict=False)
    ):
        want = ["B", *(("any" if d is None else d) for d in spec.shape)]
        raise InvalidArgument(f"inputs: shape {list(x.shape)}, model expects {want}")
    if spec.ids_below and x.size:
        outside = (x < 0) | (x >= spec.ids_below)
        if outside.any():
            bad = np.flatnonzero(outside.reshape(len(x), -1).any(axis=1))
            raise InvalidArgument(
                f"inputs: examples {bad[:10].tolist()} hold ids outside [0, {spec.ids_below}), "
                f"the rows of embedding {spec.ids_of!r}"
            )
    if x.dtype.kind == "f" and not np.isfinite(x).all():
        bad = np.flatnonzero(~np.isfinite(x.reshape(len(x), -1)).all(axis=1))
        raise InvalidArgument(
            f"inputs: examples {bad[:10].tolist()} hold NaN or infinity; their gradients "
            "would be NaN too: drop or fix them"
        )
