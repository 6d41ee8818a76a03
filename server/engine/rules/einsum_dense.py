"""EinsumDense: z = einsum(IN,KER->OUT)(a, W) + b (MultiHeadAttention's projections).

Per example, with b the batch letter: dW_b = einsum(IN,OUT->b KER)(a, g); the bias
gradient sums g over every output axis the bias does not span.
"""

from __future__ import annotations

import string

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad
from pergrad.server.engine.rules import Rule


def _specs(layer: keras.layers.EinsumDense, rank: int) -> tuple[str, str, str]:
    """(input, kernel, output) letters, with '...' spelled out for an input of `rank`."""
    inputs, rest = layer.equation.split(",")
    kernel, output = rest.split("->")
    if "..." in inputs:
        unused = [c for c in string.ascii_letters if c not in layer.equation]
        ellipsis = "".join(unused[: rank - (len(inputs) - 3)])
        inputs, output = inputs.replace("...", ellipsis), output.replace("...", ellipsis)
    return inputs, kernel, output


def _applies(layer: keras.layers.EinsumDense) -> str | None:
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return "LoRA or quantized EinsumDense"
    inputs, rest = layer.equation.split(",")
    kernel, output = rest.split("->")
    leading_ellipsis = inputs.startswith("...") and output.startswith("...")
    if "..." in kernel or not (
        leading_ellipsis or (inputs[0] == output[0] != "." and inputs[0] not in kernel)
    ):
        return f"equation {layer.equation!r} has no leading batch axis"
    return None


def per_example(
    layer: keras.layers.EinsumDense, inputs: tf.Tensor, output_grad: tf.Tensor
) -> dict[str, Grad]:
    ins, kernel, out = _specs(layer, len(inputs.shape))
    batch = ins[0]
    grads: dict[str, Grad] = {
        layer.kernel.path: tf.einsum(f"{ins},{out}->{batch}{kernel}", inputs, output_grad)
    }
    if layer.bias is not None:
        first = min(out.index(c) for c in layer.bias_axes)
        kept = "".join(c for c in out[first:] if c in layer.bias_axes)
        summed = tf.einsum(f"{out}->{batch}{kept}", output_grad)
        grads[layer.bias.path] = tf.reshape(summed, [-1, *layer.bias.shape])
    return grads


RULE = Rule(per_example, _applies)
# The layer classes (exactly these; a subclass may change the math) this rule covers.
LAYERS = (keras.layers.EinsumDense,)
