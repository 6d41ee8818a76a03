"""examples/noise_scale.py: the gradient noise scale from MOMENTS over a stream."""

from __future__ import annotations

import numpy as np
import pytest
from _common import digits_28x28
from noise_scale import noise_scale

from pergrad.client import GradientClient
from tests.examples.helpers import fresh_target, run_example


@pytest.fixture(scope="module")
def summary() -> dict[str, str]:
    with fresh_target() as target:
        return run_example("noise_scale", "--target", target, "--epochs", "1")


def test_noise_scale_is_positive_and_finite_before_and_after_training(
    summary: dict[str, str],
) -> None:
    for key in ("initial_noise_scale", "final_noise_scale"):
        assert 0 < float(summary[key]) < np.inf, key


def test_noise_scale_uses_the_unbiased_estimators_on_full_per_example_gradients(
    client: GradientClient,
) -> None:
    x, y = digits_28x28()
    x, y = x[:300], y[:300]  # two stream batches: 256 and 44
    full = client.per_example_gradients("mnist_cnn", x, y).gradients
    flat = np.concatenate([g.reshape(len(x), -1) for g in full.values()], 1).astype(np.float64)
    trace = flat.var(axis=0, ddof=1).sum()
    gradient = np.square(flat.mean(axis=0)).sum() - trace / len(x)

    loss, got_gradient, got_trace, scale = noise_scale(client, "mnist_cnn", x, y, version=1)

    assert got_trace == pytest.approx(trace, rel=1e-4)
    assert got_gradient == pytest.approx(gradient, rel=1e-4)
    assert scale == pytest.approx(trace / gradient, rel=1e-4)
    assert loss == pytest.approx(np.log(10), rel=0.2)
