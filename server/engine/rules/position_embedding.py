"""pergrad's PositionEmbedding: z = x + P. Per example: dP_b = g_b."""

from __future__ import annotations

import tensorflow as tf

from pergrad.server.engine.grads import Grad
from pergrad.server.engine.rules import Rule
from pergrad.server.models.builtin import PositionEmbedding


def per_example(
    layer: PositionEmbedding, inputs: tf.Tensor, output_grad: tf.Tensor
) -> dict[str, Grad]:
    return {layer.positions.path: output_grad}


RULE = Rule(per_example)
