"""pergrad's PositionEmbedding: z = x + P. Per example: dP_b = g_b."""

from __future__ import annotations

import tensorflow as tf

from pergrad.server.engine.grads import Grad
from pergrad.server.engine.layers import PositionEmbedding
from pergrad.server.engine.rules import Rule


def per_example(
    layer: PositionEmbedding, inputs: tf.Tensor, output_grad: tf.Tensor
) -> dict[str, Grad]:
    return {layer.positions.path: output_grad}


RULE = Rule(per_example)
# The layer classes (exactly these; a subclass may change the math) this rule covers.
LAYERS = (PositionEmbedding,)
