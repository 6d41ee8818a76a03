"""ReversibleEmbedding: a table E [V, D] used as a lookup, z_bt = E[ids_bt], and in reverse
as an output projection, logits_bt = h_bt K with K = E^T (tied) or its own R [D, V].

Per example, with g the gradient of the lookup's output and p that of the logits (before
any soft cap): the lookup's part is Scatter(ids, g), as `embedding.py`; the reverse part
is sum_t h_bt (x) p_bt, an `Outer`: Outer(h, p) for R, Outer(p, h) for a tied E, whose
two parts make one `Tied` gradient (`grads.combine`). Cost and memory grow with the
tokens an example holds, never with V x D: no per-example table is formed.

`forward` records which way each call went; a reverse call computes the logits itself
(the layer's reverse_dtype and logit_soft_cap as Keras applies them) so that the tape
watches them before the soft cap.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad, Outer, Scatter, as_sequence
from pergrad.server.engine.rules import Rule

LOOKUP, REVERSE = "lookup", "reverse"


def _applies(layer: keras.layers.ReversibleEmbedding) -> str | None:
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return "LoRA or quantized ReversibleEmbedding"
    return None


def forward(
    layer: keras.layers.ReversibleEmbedding,
    tape: tf.GradientTape,
    inputs: Any,
    reverse: bool = False,
) -> tuple[Any, Any, Any]:
    if not reverse:
        z = type(layer).call(layer, inputs)
        tape.watch(z)
        return z, (LOOKUP, tf.cast(inputs, tf.int64)), z
    kernel = tf.transpose(layer.embeddings) if layer.tie_weights else layer.reverse_embeddings
    h = inputs
    if layer.reverse_dtype is not None:
        h, kernel = tf.cast(h, layer.reverse_dtype), tf.cast(kernel, layer.reverse_dtype)
    logits = tf.matmul(h, kernel)
    tape.watch(logits)
    output = logits
    if layer.logit_soft_cap is not None:
        output = tf.tanh(logits / layer.logit_soft_cap) * layer.logit_soft_cap
    return output, (REVERSE, h), logits


def per_example(
    layer: keras.layers.ReversibleEmbedding, inputs: tuple[str, tf.Tensor], output_grad: tf.Tensor
) -> dict[str, Grad]:
    way, tensor = inputs
    g = as_sequence(output_grad)
    if way == LOOKUP:
        ids = tf.reshape(tensor, [tf.shape(tensor)[0], -1])
        return {layer.embeddings.path: Scatter(ids, g)}
    h = tf.cast(as_sequence(tensor), g.dtype)
    if layer.tie_weights:
        return {layer.embeddings.path: Outer(g, h)}
    return {layer.reverse_embeddings.path: Outer(h, g)}


RULE = Rule(per_example, _applies, forward)
# The layer classes (exactly these; a subclass may change the math) this rule covers.
LAYERS = (keras.layers.ReversibleEmbedding,)
