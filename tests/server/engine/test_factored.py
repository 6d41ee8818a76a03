"""The numpy algebra of factored gradients (`reductions/factored.py`: norms and weighted
sums for the reductions computed outside the pass and for shared passes), against the
per-example gradients formed in float64, on the same cases as the in-pass algebra."""

from __future__ import annotations

import numpy as np
import pytest

from pergrad.server.engine import grads as factors
from pergrad.server.engine.reductions.factored import squared_norms, weighted_sum
from tests.server.engine.test_in_pass import CASES, B, _formed


def _numpy(case: str):
    return factors.to_numpy(CASES[case]())


@pytest.mark.parametrize("case", CASES)
def test_squared_norms_match_the_formed_gradients(case: str) -> None:
    grad = _numpy(case)
    formed = _formed(grad)
    want = np.square(formed).reshape(B, -1).sum(1)
    got = squared_norms(grad, formed.shape[1:], np.dtype(np.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_weighted_sums_match_the_formed_gradients(case: str) -> None:
    grad = _numpy(case)
    formed = _formed(grad)
    weights = np.random.default_rng(1).random(B).astype(np.float32)
    got = weighted_sum(grad, weights, formed.shape[1:])
    np.testing.assert_allclose(got, np.tensordot(weights, formed, 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_materialized_gradients_are_the_formed_ones(case: str) -> None:
    grad = _numpy(case)
    formed = _formed(grad)
    out = np.empty(formed.shape, np.float32)
    factors.materialize(grad, out)
    np.testing.assert_allclose(out, formed, rtol=1e-5, atol=1e-6)
