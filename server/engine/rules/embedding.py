"""Embedding: z_bt = E[ids_bt]. Per example: dE_b[v] = sum of g_bt over the t with ids_bt = v."""

from __future__ import annotations

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad, Scatter, as_sequence
from pergrad.server.engine.rules import Rule


def _applies(layer: keras.layers.Embedding) -> str | None:
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return "LoRA or quantized Embedding"
    return None


def per_example(
    layer: keras.layers.Embedding, inputs: tf.Tensor, output_grad: tf.Tensor
) -> dict[str, Grad]:
    ids = tf.reshape(tf.cast(inputs, tf.int64), [tf.shape(inputs)[0], -1])
    return {layer.embeddings.path: Scatter(ids, as_sequence(output_grad))}


RULE = Rule(per_example, _applies)
# The layer classes (exactly these; a subclass may change the math) this rule covers.
LAYERS = (keras.layers.Embedding,)
