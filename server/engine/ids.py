"""Embedding ids a model computes, checked before the pass, wherever the embedding sits.

`batch.make_batch` checks an input that feeds an embedding directly. An embedding behind
other layers (ids cast, hashed or sliced from an input) sees ids no input check reaches,
and an id outside its table does not fail cleanly in the pass: under XLA the lookup
clamps it to another row, without XLA Keras wraps a negative id to the end of the table,
and an id past the end fails deep in TensorFlow. So each such embedding gets a probe, the
model's own graph from its inputs to the embedding's ids, run on the batch first; an
example whose ids fall outside the table is refused by name, and, since the check runs per
request, never reaches a pass it would share with other callers.

The probe runs with the model's own weights (layers that compute ids hold none in
practice), compiled once: run eagerly, Keras's Python cost several times the pass
(`benchmarks/zoo.py`, computed_ids: 2.55x vectorized_map's time before, 1.24x after).
An embedding inside a functional model nested in another (a keras-hub backbone under a
classifier head, called on new inputs) is probed through the nested model, called on what
the outer graph gives it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from pergrad.server.engine.batch import Batch, embedding_ids
from pergrad.server.engine.flat_call import FlatCall
from pergrad.server.errors import InvalidArgument


@dataclass(frozen=True)
class _Probe:
    layer: str
    ids_below: int
    ids_of: Callable[[Any], tf.Tensor]  # the model's inputs -> this embedding's ids


class ComputedIds:
    """The probes of a model's embeddings whose ids a layer computes."""

    def __init__(self, model: keras.Model) -> None:
        self._single = len(model.inputs) == 1
        self._probes = tuple(_probes(model))

    def __bool__(self) -> bool:
        return bool(self._probes)

    def check(self, batch: Batch) -> None:
        """InvalidArgument naming the examples whose computed ids fall outside a table."""
        inputs = batch.xs[0] if self._single else list(batch.xs)
        for probe in self._probes:
            ids = np.asarray(probe.ids_of(inputs))
            outside = ((ids < 0) | (ids >= probe.ids_below)).reshape(len(ids), -1).any(axis=1)
            if outside.any():
                bad = np.flatnonzero(outside)
                raise InvalidArgument(
                    f"inputs: examples {bad[:10].tolist()} give embedding {probe.layer!r} ids "
                    f"outside [0, {probe.ids_below}) (its table's rows)"
                )


def _probes(model: keras.Model) -> list[_Probe]:
    probes = []
    inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
    for layer, ids in embedding_ids(model):
        if any(ids is tensor for tensor in model.inputs):
            continue  # an input: make_batch checks it
        try:
            probe = keras.Model(inputs, ids)
        except ValueError:  # not reachable from the model's inputs
            continue
        probes.append(_Probe(layer.name, layer.input_dim, _compiled(probe)))
    return probes


def _compiled(probe: keras.Model) -> Callable[[Any], tf.Tensor]:
    """The probe as one graph of any batch size, called flat (`FlatCall`)."""
    specs = [tf.TensorSpec((None, *x.shape[1:]), x.dtype) for x in probe.inputs]
    signature = specs if len(specs) == 1 else [specs]
    return FlatCall(
        tf.function(lambda inputs: probe(inputs, training=False), input_signature=signature)
    )
