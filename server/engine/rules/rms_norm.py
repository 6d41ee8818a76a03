"""RMS normalization: z = x_hat * scale (or x_hat * (1 + scale), Gemma's form), with
x_hat = x / sqrt(mean(x^2) + eps) over the last axis (Keras' RMSNormalization: over its
`axis`).

Per example: dscale_b = sum over the axes the scale does not span of g_b * x_hat_b, in
both forms. Besides Keras' own class, keras-hub defines one such layer per model family
(Gemma, Llama, Mistral, Qwen, Phi-3, T5, ...), and the next family will bring another: so
this rule is also offered every layer of a class no rule names that holds one trainable
vector, and takes it when the layer computes one of the two forms (`_computes_rms_norm`:
the layer run on a probe input with a random scale, against the formula). A class whose
math differs fails the probe and takes the generic route, with the reason in the plan.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from pergrad.server.engine.grads import Grad
from pergrad.server.engine.rules import Rule
from pergrad.server.engine.rules.layer_norm import norm_axes, reduce_to_params

# The probe's agreement with the formula: float32 rounding of a few operations.
_PROBE_TOLERANCE = 1e-5


def _scale(layer: keras.layers.Layer) -> keras.Variable:
    return layer.trainable_variables[0]


def _normalized(x: tf.Tensor, axes: list[int], epsilon: float) -> tf.Tensor:
    mean_square = tf.reduce_mean(tf.square(x), axis=axes, keepdims=True)
    return x * tf.math.rsqrt(mean_square + epsilon)


def _axes(layer: keras.layers.Layer, rank: int) -> list[int]:
    return (
        norm_axes(layer, rank) if isinstance(layer, keras.layers.RMSNormalization) else [rank - 1]
    )


def _computes_rms_norm(layer: keras.layers.Layer) -> bool:
    """Whether the layer, run with a random scale on a random input, gives x_hat * scale or
    x_hat * (1 + scale)."""
    scale = _scale(layer)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, *scale.shape)).astype(np.float32) + 0.5
    values = rng.standard_normal(scale.shape).astype(np.float32)
    try:
        z, _ = layer.stateless_call([values], [v.value for v in layer.non_trainable_variables], x)
    except Exception:  # any failure of a foreign layer on the probe: not this form
        return False
    x_hat = _normalized(tf.constant(x), [2], float(layer.epsilon)).numpy()
    z = np.asarray(z, np.float32)
    return any(
        np.allclose(z, x_hat * (offset + values), rtol=_PROBE_TOLERANCE, atol=_PROBE_TOLERANCE)
        for offset in (0.0, 1.0)
    )


def _applies(layer: keras.layers.Layer) -> str | None:
    name = type(layer).__name__
    if isinstance(layer, keras.layers.RMSNormalization):
        return None
    own = layer.trainable_variables
    if (
        len(own) != 1
        or len(own[0].shape) != 1
        or not isinstance(getattr(layer, "epsilon", None), float | int)
    ):
        return f"no rule for {name}"
    if not _computes_rms_norm(layer):
        return f"no rule for {name} (it holds one vector, but is no RMS normalization)"
    return None


def per_example(
    layer: keras.layers.Layer, inputs: tf.Tensor, output_grad: tf.Tensor
) -> dict[str, Grad]:
    axes = _axes(layer, len(inputs.shape))
    x_hat = _normalized(tf.cast(inputs, tf.float32), axes, float(layer.epsilon))
    g = tf.cast(output_grad, tf.float32)
    return {_scale(layer).path: reduce_to_params(g * x_hat, axes)}


RULE = Rule(per_example, _applies)
# The layer classes (exactly these; a subclass may change the math) this rule covers; it is
# also offered every layer of a class no rule names (`FOUND_BY_PROBE`).
LAYERS = (keras.layers.RMSNormalization,)
FOUND_BY_PROBE = True
