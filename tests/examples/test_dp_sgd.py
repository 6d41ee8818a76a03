"""examples/dp_sgd.py: DP-SGD through pergrad learns, accounts its privacy, and each step
is exactly clip, sum, seeded noise and SGD."""

from __future__ import annotations

import struct
from pathlib import Path

import dp_accounting
import grpc
import numpy as np
import pytest
from _common import digits_28x28
from dp_accounting import pld
from dp_sgd import DpSgd

from pergrad.client import GradientClient, PergradError
from tests import spec_random
from tests.examples.helpers import fresh_target, run_example

NOISE_STREAM = 2  # variable i's seeded noise: the Gaussian stream (seed, i, 2) of the proto
# mnist_cnn's first 16 digits have gradient norms from 4.3 to 8.0 at the initial weights.
MAX_NORM, NOISE, LR, EXPECTED_BATCH = 5.5, 1.1, 0.3, 20.0


@pytest.fixture(scope="module")
def plot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("plot") / "dp_sgd.png"


@pytest.fixture(scope="module")
def summary(plot: Path) -> dict[str, str]:
    with fresh_target() as target:
        args = ("--target", target, "--epochs", "2", "--seed", "0", "--plot", str(plot))
        return run_example("dp_sgd", *args)


def test_the_plot_asked_for_is_written_as_a_png_of_its_figure_size(
    summary: dict[str, str], plot: Path
) -> None:
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (9 * 120, 420)  # 9 x 3.5 inches at 120 dpi


def test_dp_sgd_test_accuracy_beats_chance_by_a_clear_margin(summary: dict[str, str]) -> None:
    assert int(summary["test_examples"]) == 300
    assert float(summary["test_accuracy"]) > 0.5  # chance: 0.1


def test_reported_epsilon_is_dp_accountings_for_the_same_steps(summary: dict[str, str]) -> None:
    q, steps = float(summary["sampling_rate"]), int(summary["steps"])
    assert q == pytest.approx(128 / int(summary["train_examples"]))
    assert steps == 2 * round(1 / q)
    accountant = pld.PLDAccountant(value_discretization_interval=1e-3)
    accountant.compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.0)), steps
    )
    expected = accountant.get_epsilon(1e-5)
    assert np.isfinite(expected) and expected > 0
    assert float(summary["epsilon"]) == pytest.approx(expected, rel=1e-9)


def _reference_step(
    client: GradientClient, version: int, x: np.ndarray, y: np.ndarray, *, seed: int
) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(noisy sum of clipped per-example gradients, per-example norms) in float64 numpy,
    from the full per-example gradients at `version`."""
    full = client.per_example_gradients("mnist_cnn", x, y, model_version=version).gradients
    flat = np.concatenate([g.reshape(len(x), -1) for g in full.values()], axis=1)
    norms = np.linalg.norm(flat.astype(np.float64), axis=1)
    scale = np.minimum(1.0, MAX_NORM / norms)
    noisy = {}
    for index, variable in enumerate(client.model_info("mnist_cnn").variables):
        clipped = np.tensordot(scale, full[variable.name].astype(np.float64), axes=1)
        key = spec_random.key(seed, index, NOISE_STREAM)
        count = int(np.prod(variable.shape))
        noise = np.reshape([spec_random.gaussian(key, n) for n in range(count)], variable.shape)
        noisy[variable.name] = clipped + NOISE * MAX_NORM * noise
    return noisy, norms


def test_a_dp_sgd_step_equals_clip_sum_seeded_noise_and_sgd_in_numpy(
    client: GradientClient,
) -> None:
    x, y = digits_28x28()
    x, y = x[:16], y[:16]
    dp = DpSgd(
        client,
        "mnist_cnn",
        max_norm=MAX_NORM,
        noise_multiplier=NOISE,
        expected_batch_size=EXPECTED_BATCH,
        lr=LR,
    )
    before = {name: w.astype(np.float64) for name, w in client.get_weights("mnist_cnn")[1].items()}
    noisy, norms = _reference_step(client, dp.version, x, y, seed=1234)
    assert 0 < (norms > MAX_NORM).sum() < len(x)  # some examples clipped, some not

    dp.step(x, y, seed=1234)

    version, after = client.get_weights("mnist_cnn")
    assert version == dp.version == 2
    for name, start in before.items():
        expected = start - LR * noisy[name] / EXPECTED_BATCH
        error = np.linalg.norm(after[name] - expected) / np.linalg.norm(expected - start)
        assert error < 1e-5, name


def test_a_dp_sgd_step_refuses_weights_another_writer_changed(client: GradientClient) -> None:
    x, y = digits_28x28()
    dp = DpSgd(
        client, "mnist_cnn", max_norm=1.0, noise_multiplier=1.0, expected_batch_size=8, lr=0.1
    )
    _, weights = client.get_weights("mnist_cnn")
    client.set_weights("mnist_cnn", weights)  # someone else moves the model to version 2
    with pytest.raises(PergradError) as failure:
        dp.step(x[:8], y[:8], seed=0)
    assert failure.value.code == grpc.StatusCode.FAILED_PRECONDITION
