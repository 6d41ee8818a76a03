"""Norms and clipped sums inside the compiled pass, in float32, from the factored gradients.

The same algebra as `reductions/factored.py` (which serves the other reductions and
shared passes in numpy, float64), in TensorFlow: on the pass's own threads, with no
per-example tensor leaving it, and for clipped sums no numpy scatter. Squared norms of a
variable are accumulated per example in float32; their relative error against the
float64 loop stays near float32's epsilon times the number of terms summed per example
(tests hold it to 1e-5).

- Outer (a [B, T, I], g [B, T, J]): ||a_b||^2 ||g_b||^2 for one step; for T steps the Gram
  form <A A^T, G G^T> where T (I + J) < I J (ghost clipping), else the per-example matrix.
- Scatter (ids [B, T], g [B, T, D]): sum over step pairs with the same id of g_t . g_s.
- Tied (a Scatter and an Outer [V, D] of one table): both norms and twice their inner
  product, sum over t, s of p_s[ids_t] (g_t . h_s) for the projection Outer(p, h): a
  [B, T, T] product, never a [V, D] per example.
- A weighted sum is one contraction: (w a)^T g as one matrix product over the flattened
  examples and steps, or a segment sum over ids; where the norms formed the per-example
  matrices, the weights contract those instead (B I J products, not B T I J). (Without
  XLA `tf.einsum` over a batch axis runs 5-8x slower than the same contraction as a
  matmul here.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tensorflow as tf

from pergrad.server.engine.grads import Grad, Outer, Scatter, Tied
from pergrad.server.engine.reductions.clipped_sum import clip_factors


@dataclass(frozen=True)
class InPass:
    """A reduction computed in the pass: the variables it covers (positions in model
    order) and whether it clips and sums them besides their norms; the compiled function
    is made once per InPass. A reduction class says it can by `IN_PASS_CLIP`."""

    positions: tuple[int, ...]
    clip: bool


def _gram_norms(a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    gram_a = tf.matmul(a, a, transpose_b=True)
    gram_g = tf.matmul(g, g, transpose_b=True)
    return tf.reduce_sum(gram_a * gram_g, [1, 2])


def _narrow_first(a: tf.Tensor, g: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """(a, g), or (g, a) where g is the narrower: TensorFlow's batched product of [B, T, I]
    and [B, T, J] over T runs 1.3-1.7x faster with the narrower side as the result's rows
    here ([J, I] for mnist_cnn's conv1, I=64 and J=16; a LoRA factor's rank) and alike
    where the two are close."""
    return (g, a) if _g_narrower(a, g) else (a, g)


def _g_narrower(a: tf.Tensor, g: tf.Tensor) -> bool:
    return g.shape[-1] < a.shape[-1]


def _ghost(steps: Any, inputs: int, outputs: int) -> Any:
    """Whether the Gram matrices cost less than the per-example matrices: T (I + J) < I J
    (`steps` a number, or a tensor where T is known only at run time)."""
    return steps * (inputs + outputs) < inputs * outputs


def _formed(a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """The per-example matrices, [B, I, J], or [B, J, I] where g is the narrower."""
    first, second = _narrow_first(a, g)
    return tf.matmul(first, second, transpose_a=True)


def _formed_norms(a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(tf.square(_formed(a, g)), [1, 2])


def _formed_outer(grad: Grad | None) -> tf.Tensor | None:
    """An Outer gradient's per-example matrices (`_formed`) where its norms form them,
    T known and over 1, else None: a clipped sum then weighs those, B I J products,
    rather than the factors again, B T I J."""
    if not isinstance(grad, Outer):
        return None
    steps, inputs, outputs = grad.a.shape[1], grad.a.shape[2], grad.g.shape[2]
    if steps is None or steps == 1 or _ghost(steps, inputs, outputs):
        return None
    return _formed(tf.cast(grad.a, tf.float32), tf.cast(grad.g, tf.float32))


def _outer_norms(a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """By the Gram matrices where T (I + J) < I J, else by the per-example matrices;
    decided at run time where T is known only then."""
    steps, inputs, outputs = a.shape[1], a.shape[2], g.shape[2]
    if steps == 1:
        return tf.reduce_sum(tf.square(a[:, 0]), 1) * tf.reduce_sum(tf.square(g[:, 0]), 1)
    if steps is not None:
        return _gram_norms(a, g) if _ghost(steps, inputs, outputs) else _formed_norms(a, g)
    ghost = _ghost(tf.shape(a)[1], inputs, outputs)
    return tf.cond(ghost, lambda: _gram_norms(a, g), lambda: _formed_norms(a, g))


def _tied_cross(lookup: Scatter, projection: Outer) -> tf.Tensor:
    """<lookup_b, projection_b> for each example b: [B]."""
    g = tf.cast(lookup.g, tf.float32)
    p, h = tf.cast(projection.a, tf.float32), tf.cast(projection.g, tf.float32)
    dots = tf.matmul(g, h, transpose_b=True)  # [B, T, S]: g_t . h_s
    at_ids = tf.gather(p, lookup.ids, axis=2, batch_dims=1)  # [B, S, T]: p_s[ids_t]
    return tf.reduce_sum(dots * tf.transpose(at_ids, [0, 2, 1]), [1, 2])


def squared_norms(grad: Grad) -> tf.Tensor:
    """||grad_b||^2 for each example b: [B] float32."""
    if isinstance(grad, Tied):
        cross = _tied_cross(grad.lookup, grad.projection)
        return squared_norms(grad.lookup) + squared_norms(grad.projection) + 2 * cross
    if isinstance(grad, Outer):
        return _outer_norms(tf.cast(grad.a, tf.float32), tf.cast(grad.g, tf.float32))
    if isinstance(grad, Scatter):
        g = tf.cast(grad.g, tf.float32)
        same = tf.cast(tf.equal(grad.ids[:, :, None], grad.ids[:, None, :]), tf.float32)
        return tf.reduce_sum(tf.matmul(g, g, transpose_b=True) * same, [1, 2])
    dense = tf.cast(grad, tf.float32)
    return tf.reduce_sum(tf.reshape(tf.square(dense), [tf.shape(dense)[0], -1]), 1)


def _flat_steps(t: tf.Tensor) -> tf.Tensor:
    """[B, T, D] as [B T, D]."""
    return tf.reshape(t, [-1, tf.shape(t)[-1]])


def weighted_sum(grad: Grad, weights: tf.Tensor, shape: Sequence[int]) -> tf.Tensor:
    """sum_b weights_b grad_b, shaped like the variable, float32."""
    if isinstance(grad, Tied):
        return weighted_sum(grad.lookup, weights, shape) + weighted_sum(
            grad.projection, weights, shape
        )
    if isinstance(grad, Outer):  # the weights scale the narrower factor: fewer products
        a, g = tf.cast(grad.a, tf.float32), tf.cast(grad.g, tf.float32)
        if _g_narrower(a, g):
            g = g * weights[:, None, None]
        else:
            a = a * weights[:, None, None]
        return tf.reshape(tf.matmul(_flat_steps(a), _flat_steps(g), transpose_a=True), shape)
    if isinstance(grad, Scatter):
        g = tf.cast(grad.g, tf.float32) * weights[:, None, None]
        return tf.math.unsorted_segment_sum(_flat_steps(g), tf.reshape(grad.ids, [-1]), shape[0])
    flat = tf.reshape(tf.cast(grad, tf.float32), [tf.shape(weights)[0], -1])
    return tf.reshape(tf.matmul(weights[None], flat), shape)


def reduce(
    spec: InPass,
    grads: Sequence[Grad | None],
    shapes: Sequence[Sequence[int]],
    rows: tf.Tensor,
    max_norm: tf.Tensor,
) -> dict[str, tf.Tensor | list[tf.Tensor]]:
    """The in-pass outputs of `spec` for one pass: `squares` [V, B] (one row per covered
    variable); for clipped sums also `sums`, one per covered variable. `rows` [B] is 1 for
    the pass's real examples and 0 for its padding, which adds nothing to a sum. A
    gradient of None (a layer the forward pass never called) is zero."""
    zero = tf.zeros_like(rows)
    formed = {i: _formed_outer(grads[i]) for i in spec.positions}
    squares = tf.stack([_squares(grads[i], formed[i], zero) for i in spec.positions])
    if not spec.clip:
        return {"squares": squares}
    norms = tf.sqrt(tf.reduce_sum(squares, 0))
    scale = clip_factors(norms, max_norm, ops=tf.math) * rows
    sums = [_clipped_sum(grads[i], formed[i], scale, shapes[i]) for i in spec.positions]
    return {"squares": squares, "sums": sums}


def _squares(grad: Grad | None, formed: tf.Tensor | None, zero: tf.Tensor) -> tf.Tensor:
    """||grad_b||^2, from its formed matrices where its norms form them."""
    if grad is None:
        return zero
    return squared_norms(grad) if formed is None else tf.reduce_sum(tf.square(formed), [1, 2])


def _clipped_sum(
    grad: Grad | None, formed: tf.Tensor | None, scale: tf.Tensor, shape: Sequence[int]
) -> tf.Tensor:
    """sum_b scale_b grad_b, from its formed matrices where its norms formed them."""
    if grad is None:
        return tf.zeros(shape)
    if formed is None:
        return weighted_sum(grad, scale, shape)
    total = tf.tensordot(scale, formed, 1)  # [I, J], or [J, I] where g is the narrower
    if isinstance(grad, Outer) and _g_narrower(grad.a, grad.g):
        total = tf.transpose(total)
    return tf.reshape(total, shape)
