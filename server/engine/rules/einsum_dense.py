"""EinsumDense: z = einsum(IN,KER->OUT)(a, W) + b (attention projections; W = W0 + s A B
under LoRA: `lora.py`).

Per example, with b the batch letter: dW_b = einsum(IN,OUT->b KER)(a, g). Where the
equation is a Dense over some axes, the kernel's letters the input's contracted ones
then the output's own (MultiHeadAttention's "abc,cde->abde" and "abcd,cde->abe",
keras-hub's "btd,df->btf"), this is kept factored: Outer(a as [B, T, C], g as [B, T, F]),
T the steps the two share. Otherwise (Gemma's "btd,ndh->btnh") it is formed. The bias
gradient sums g over every output axis the bias does not span.
"""

from __future__ import annotations

import math
import string

import keras
import tensorflow as tf

from pergrad.server.engine.grads import Grad, Outer
from pergrad.server.engine.rules import Rule
from pergrad.server.engine.rules.lora import kernel_and_factors


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
    if getattr(layer, "quantization_mode", None):
        return "quantized EinsumDense"
    inputs, rest = layer.equation.split(",")
    kernel, output = rest.split("->")
    leading_ellipsis = inputs.startswith("...") and output.startswith("...")
    if "..." in kernel or not (
        leading_ellipsis or (inputs[0] == output[0] != "." and inputs[0] not in kernel)
    ):
        return f"equation {layer.equation!r} has no leading batch axis"
    return None


def _dense_over(ins: str, kernel: str, out: str) -> tuple[str, int] | None:
    """(the shared step letters in output order, how many of the kernel's letters the
    input contracts) where the equation is a Dense over some axes, else None."""
    steps = "".join(c for c in out if c in ins)
    contracted = "".join(c for c in kernel if c in ins)
    own = "".join(c for c in kernel if c in out)
    if any(c in kernel for c in steps) or kernel != contracted + own:
        return None
    if set(ins) != set(steps + contracted) or set(out) != set(steps + own):
        return None
    return steps, len(contracted)


def _as_steps(t: tf.Tensor, spec: str, order: str, width: int) -> tf.Tensor:
    """`t` (letters `spec`) permuted to `order` and read as [B, T, width]."""
    permutation = [spec.index(c) for c in order]
    if permutation != list(range(len(spec))):
        t = tf.transpose(t, permutation)
    return tf.reshape(t, [tf.shape(t)[0], -1, width])


def _kernel_grad(
    layer: keras.layers.EinsumDense, inputs: tf.Tensor, output_grad: tf.Tensor
) -> Grad:
    ins, kernel, out = _specs(layer, len(inputs.shape))
    dense_over = _dense_over(ins, kernel, out)
    if dense_over is None:
        return tf.einsum(f"{ins},{out}->{ins[0]}{kernel}", inputs, output_grad)
    steps, contracted = dense_over
    shape = tuple(layer._kernel.shape)
    a = _as_steps(inputs, ins, steps + kernel[:contracted], math.prod(shape[:contracted]))
    g = _as_steps(output_grad, out, steps + kernel[contracted:], math.prod(shape[contracted:]))
    return Outer(a, g)


def per_example(
    layer: keras.layers.EinsumDense, inputs: tf.Tensor, output_grad: tf.Tensor
) -> dict[str, Grad]:
    grads = kernel_and_factors(layer, _kernel_grad(layer, inputs, output_grad))
    if layer.bias is not None:
        out = _specs(layer, len(inputs.shape))[2]
        first = min(out.index(c) for c in layer.bias_axes)
        kept = "".join(c for c in out[first:] if c in layer.bias_axes)
        summed = tf.einsum(f"{out}->{out[0]}{kept}", output_grad)
        grads[layer.bias.path] = tf.reshape(summed, [-1, *layer.bias.shape])
    return grads


RULE = Rule(per_example, _applies)
# The layer classes (exactly these; a subclass may change the math) this rule covers.
LAYERS = (keras.layers.EinsumDense,)
