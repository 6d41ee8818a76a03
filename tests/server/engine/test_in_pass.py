"""In-pass reductions: squared norms and weighted sums of factored gradients, in float32,
against the per-example gradients formed in float64 numpy."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from pergrad.server.engine.grads import Outer, Scatter, Tied
from pergrad.server.engine.in_pass import InPass, reduce, squared_norms, weighted_sum

B = 6
rng = np.random.default_rng(0)


def _outer(steps: int, inputs: int, outputs: int) -> Outer:
    a = rng.standard_normal((B, steps, inputs)).astype(np.float32)
    return Outer(tf.constant(a), tf.constant(rng.standard_normal((B, steps, outputs)), tf.float32))


def _formed(grad) -> np.ndarray:
    """[B, *shape] per-example gradients in float64."""
    if isinstance(grad, Tied):
        return _formed(grad.lookup) + _formed(grad.projection)
    if isinstance(grad, Outer):
        a, g = (np.asarray(t, np.float64) for t in grad)
        return np.einsum("bti,btj->bij", a, g)
    if isinstance(grad, Scatter):
        ids, g = np.asarray(grad.ids), np.asarray(grad.g, np.float64)
        out = np.zeros((B, 11, g.shape[-1]))
        for b in range(B):
            np.add.at(out[b], ids[b], g[b])
        return out
    return np.asarray(grad, np.float64)


CASES = {
    "outer_one_step": lambda: _outer(1, 7, 5),
    "outer_gram": lambda: _outer(2, 40, 30),  # T (I + J) < I J
    "outer_formed": lambda: _outer(20, 3, 4),  # T (I + J) >= I J
    "outer_formed_g_narrower": lambda: _outer(20, 4, 3),
    "scatter": lambda: Scatter(
        tf.constant(rng.integers(0, 11, (B, 9)), tf.int32),
        tf.constant(rng.standard_normal((B, 9, 4)), tf.float32),
    ),
    "dense": lambda: tf.constant(rng.standard_normal((B, 3, 2)), tf.float32),
    # a table [11, 4] looked up at 9 steps and used as the output projection at 5
    "tied": lambda: Tied(
        Scatter(
            tf.constant(rng.integers(0, 11, (B, 9)), tf.int32),
            tf.constant(rng.standard_normal((B, 9, 4)), tf.float32),
        ),
        _outer(5, 11, 4),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_squared_norms_match_the_formed_gradients(case: str) -> None:
    grad = CASES[case]()
    want = np.square(_formed(grad)).reshape(B, -1).sum(1)
    np.testing.assert_allclose(squared_norms(grad).numpy(), want, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_weighted_sums_match_the_formed_gradients(case: str) -> None:
    grad = CASES[case]()
    formed = _formed(grad)
    weights = rng.random(B).astype(np.float32)
    got = weighted_sum(grad, tf.constant(weights), formed.shape[1:]).numpy()
    np.testing.assert_allclose(got, np.tensordot(weights, formed, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("steps", [2, 30])
def test_steps_known_only_at_run_time_choose_either_algebra_rightly(steps: int) -> None:
    grad = _outer(steps, 12, 10)
    spec = tf.TensorSpec([None, None, None], tf.float32)

    @tf.function(input_signature=[spec, spec])
    def norms(a: tf.Tensor, g: tf.Tensor) -> tf.Tensor:
        return squared_norms(
            Outer(tf.ensure_shape(a, [None, None, 12]), tf.ensure_shape(g, [None, None, 10]))
        )

    want = np.square(_formed(grad)).reshape(B, -1).sum(1)
    np.testing.assert_allclose(norms(*grad).numpy(), want, rtol=1e-5)


def test_clipped_sums_scale_each_example_and_leave_out_padding() -> None:
    grads = [_outer(1, 4, 3), None]
    rows = np.ones(B, np.float32)
    rows[-2:] = 0  # padding
    max_norm = 1.0
    out = reduce(InPass((0, 1), clip=True), grads, [(4, 3), (5,)], tf.constant(rows), max_norm)
    formed = _formed(grads[0])
    norms = np.sqrt(np.square(formed).reshape(B, -1).sum(1))
    scale = np.minimum(1.0, max_norm / norms) * rows
    want = np.tensordot(scale, formed, 1)
    np.testing.assert_allclose(out["sums"][0].numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(out["sums"][1].numpy(), np.zeros(5))
    np.testing.assert_array_equal(out["squares"][1].numpy(), np.zeros(B))


@pytest.mark.parametrize("case", CASES)
def test_clipped_sums_match_the_formed_gradients(case: str) -> None:
    """Each algebra's clipped sum (where the norms form the per-example matrices, from
    those), against the formed gradients clipped and summed in float64."""
    grad = CASES[case]()
    formed = _formed(grad)
    norms = np.sqrt(np.square(formed).reshape(B, -1).sum(1))
    max_norm = float(np.median(norms))  # some examples clipped, some not
    rows = tf.ones(B)
    out = reduce(InPass((0,), clip=True), [grad], [formed.shape[1:]], rows, max_norm)
    want = np.tensordot(np.minimum(1.0, max_norm / norms), formed, 1)
    np.testing.assert_allclose(out["sums"][0].numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["squares"][0].numpy(), np.square(norms), rtol=1e-5)
