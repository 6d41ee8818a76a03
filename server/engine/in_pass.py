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
- A weighted sum is one contraction: (w a)^T g, or a segment sum over ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import tensorflow as tf

from pergrad.server.engine.grads import Grad, Outer, Scatter
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


def _formed_norms(a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    return tf.reduce_sum(tf.square(tf.matmul(a, g, transpose_a=True)), [1, 2])


def _outer_norms(a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
    """By the Gram matrices where T (I + J) < I J, else by the per-example matrices;
    decided at run time where T is known only then."""
    steps, inputs, outputs = a.shape[1], a.shape[2], g.shape[2]
    if steps == 1:
        return tf.reduce_sum(tf.square(a[:, 0]), 1) * tf.reduce_sum(tf.square(g[:, 0]), 1)
    if steps is not None:
        ghost = steps * (inputs + outputs) < inputs * outputs
        return _gram_norms(a, g) if ghost else _formed_norms(a, g)
    ghost = tf.shape(a)[1] * (inputs + outputs) < inputs * outputs
    return tf.cond(ghost, lambda: _gram_norms(a, g), lambda: _formed_norms(a, g))


def squared_norms(grad: Grad) -> tf.Tensor:
    """||grad_b||^2 for each example b: [B] float32."""
    if isinstance(grad, Outer):
        return _outer_norms(tf.cast(grad.a, tf.float32), tf.cast(grad.g, tf.float32))
    if isinstance(grad, Scatter):
        g = tf.cast(grad.g, tf.float32)
        same = tf.cast(tf.equal(grad.ids[:, :, None], grad.ids[:, None, :]), tf.float32)
        return tf.reduce_sum(tf.matmul(g, g, transpose_b=True) * same, [1, 2])
    dense = tf.cast(grad, tf.float32)
    return tf.reduce_sum(tf.reshape(tf.square(dense), [tf.shape(dense)[0], -1]), 1)


def weighted_sum(grad: Grad, weights: tf.Tensor, shape: Sequence[int]) -> tf.Tensor:
    """sum_b weights_b grad_b, shaped like the variable, float32."""
    if isinstance(grad, Outer):
        a = tf.cast(grad.a, tf.float32) * weights[:, None, None]
        g = tf.cast(grad.g, tf.float32)
        return tf.reshape(tf.einsum("bti,btj->ij", a, g), shape)
    if isinstance(grad, Scatter):
        g = tf.cast(grad.g, tf.float32) * weights[:, None, None]
        flat = tf.reshape(g, [-1, shape[-1]])
        return tf.math.unsorted_segment_sum(flat, tf.reshape(grad.ids, [-1]), shape[0])
    return tf.einsum("b,b...->...", weights, tf.cast(grad, tf.float32))


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
    squares = tf.stack(
        [zero if grads[i] is None else squared_norms(grads[i]) for i in spec.positions]
    )
    if not spec.clip:
        return {"squares": squares}
    norms = tf.sqrt(tf.reduce_sum(squares, 0))
    scale = clip_factors(norms, max_norm, ops=tf.math) * rows
    sums = [
        tf.zeros(shapes[i]) if grads[i] is None else weighted_sum(grads[i], scale, shapes[i])
        for i in spec.positions
    ]
    return {"squares": squares, "sums": sums}
