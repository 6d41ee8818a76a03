"""examples/dp_lora.py: DP-LoRA through a server that enables LoRA itself learns the task,
trains only the LoRA factors and the head, and accounts its privacy."""

from __future__ import annotations

import re

import dp_accounting
import pytest
from dp_accounting import pld

from tests.examples.helpers import run_example


@pytest.fixture(scope="module")
def summary() -> dict[str, str]:
    return run_example("dp_lora", "--seed", "0")


def test_dp_lora_beats_the_majority_class_by_a_clear_margin(summary: dict[str, str]) -> None:
    assert float(summary["test_accuracy"]) > float(summary["majority_share"]) + 0.1


def test_only_the_lora_factors_and_the_head_train(summary: dict[str, str]) -> None:
    layers = int(re.search(r"on (\d+) layers \(query, value\)", summary["lora"]).group(1))
    assert int(summary["trainable_variables"]) == 2 * layers + 2  # A and B each; head's two


def test_reported_epsilon_is_dp_accountings_for_the_same_steps(summary: dict[str, str]) -> None:
    q, steps = float(summary["sampling_rate"]), int(summary["steps"])
    assert q == pytest.approx(128 / int(summary["train_examples"]))
    accountant = pld.PLDAccountant(value_discretization_interval=1e-3)
    accountant.compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(0.8)), steps
    )
    assert float(summary["epsilon"]) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
