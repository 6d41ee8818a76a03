"""Dense: z = a W + b over the last axis (W = W0 + s A B under LoRA: `lora.py`).

Per example: dW_b = sum_t a_bt (x) g_bt (kept factored, `Outer`), db_b = sum_t g_bt, where t
runs over any axes between the batch and the features (one step for flat inputs).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad, Outer, as_sequence
from pergrad.server.engine.rules import Rule
from pergrad.server.engine.rules.lora import kernel_and_factors


def _applies(layer: keras.layers.Dense) -> str | None:
    if getattr(layer, "quantization_mode", None):
        return "quantized Dense"
    return None


def per_example(
    layer: keras.layers.Dense, inputs: tf.Tensor, output_grad: tf.Tensor
) -> dict[str, Grad]:
    a, g = as_sequence(inputs), as_sequence(output_grad)
    grads = kernel_and_factors(layer, Outer(a, g))
    if layer.use_bias:
        grads[layer.bias.path] = tf.reduce_sum(g, axis=1)
    return grads


RULE = Rule(per_example, _applies)
# The layer classes (exactly these; a subclass may change the math) this rule covers.
LAYERS = (keras.layers.Dense,)
