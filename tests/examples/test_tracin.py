"""examples/tracin.py: TracIn self-influence finds deliberately mislabeled digits."""

from __future__ import annotations

import numpy as np
import pytest
from tracin import flip_labels

from tests.examples.helpers import fresh_target, run_example


@pytest.fixture(scope="module")
def summary() -> dict[str, str]:
    with fresh_target() as target:
        return run_example("tracin", "--target", target, "--epochs", "2")


def test_most_flipped_labels_rank_in_the_top_of_self_influence(summary: dict[str, str]) -> None:
    assert int(summary["flipped"]) == int(summary["top"]) == round(0.05 * 1497)
    assert float(summary["base_rate"]) == pytest.approx(0.05, abs=1e-3)
    assert float(summary["self_influence_recall"]) > 0.5


def test_last_layer_self_influence_also_finds_most_flipped_labels(
    summary: dict[str, str],
) -> None:
    assert float(summary["last_layer_self_influence_recall"]) > 0.5


def test_flip_labels_moves_the_fraction_asked_each_to_another_class() -> None:
    y = np.random.default_rng(0).integers(0, 10, 1000).astype(np.int32)
    noisy, flipped = flip_labels(y, 0.05, 10, np.random.default_rng(1))
    assert flipped.sum() == 50
    assert np.all(noisy[flipped] != y[flipped])
    assert np.all(noisy[~flipped] == y[~flipped])
    assert noisy.min() >= 0 and noisy.max() <= 9
