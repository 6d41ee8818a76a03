"""keras-hub's PositionEmbedding: z_bt = P[start + t] (or P[positions_bt]), broadcast over
the batch; its input gives only the shape.

Per example: dP_b[start + t] = g_bt, a `Scatter` over the position ids, so norms and
clipped sums cost T D an example, never the table's L D. Named by its import path:
keras-hub is not a dependency of the server, and the class is known once a model that
uses it is loaded.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad, Scatter, as_sequence
from pergrad.server.engine.rules import Rule


def forward(
    layer: keras.layers.Layer,
    tape: tf.GradientTape,
    inputs: tf.Tensor,
    start_index: Any = 0,
    positions: Any = None,
) -> tuple[Any, Any, Any]:
    z = type(layer).call(layer, inputs, start_index=start_index, positions=positions)
    tape.watch(z)
    shape = tf.shape(inputs)
    if positions is None:
        positions = tf.range(shape[-2]) + tf.cast(start_index, tf.int32)
    ids = tf.broadcast_to(tf.cast(positions, tf.int64), shape[:-1])
    return z, ids, z


def per_example(
    layer: keras.layers.Layer, inputs: tf.Tensor, output_grad: tf.Tensor
) -> dict[str, Grad]:
    ids = tf.reshape(inputs, [tf.shape(inputs)[0], -1])
    return {layer.position_embeddings.path: Scatter(ids, as_sequence(output_grad))}


RULE = Rule(per_example, forward=forward)
# The layer classes this rule covers, by import path (exactly these).
LAYERS = ("keras_hub.src.layers.modeling.position_embedding.PositionEmbedding",)
