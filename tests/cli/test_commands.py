"""The `pergrad` command as a user runs it: serve in a process of its own, info, grads."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pergrad.client import GradientClient
from pergrad.server.config import Config
from pergrad.server.models.builtin import BUILTIN_MODELS, LOSS
from tests import oracle
from tests.helpers import assert_close, spawn_server, stop_server

PERGRAD = [sys.executable, "-m", "pergrad.cli"]
SERVE = [*PERGRAD, "serve", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[subprocess.Popen, str]]:
    process, target = spawn_server("--model", "mnist_mlp")
    yield process, target
    stop_server(process)


def _grads(target: str, model: str, data: Path, out: Path, *flags: str):
    return _run(
        "grads",
        "--target",
        target,
        "--model",
        model,
        "--data",
        str(data),
        "--out",
        str(out),
        *flags,
    )


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PERGRAD, *args], capture_output=True, text=True, timeout=120)


def test_info_describes_the_served_model(served) -> None:
    _, target = served
    run = _run("info", "--target", target)
    assert run.returncode == 0, run.stderr
    assert "mnist_mlp  version 1  101,770 parameters" in run.stdout
    assert "var     hidden/kernel  float32 [784, 128]" in run.stdout
    assert re.search(r"plan    [0-9a-f]{12}  XLA (on|off); slices of \d+ examples", run.stdout)
    assert f"limits  max_batch {Config().max_batch}  max_request_bytes" in run.stdout
    # the default --optimizer, and the Keras whose arithmetic it is
    assert re.search(r"steps   SGD\(momentum=0\.0, nesterov=False\)  \(Keras \d+\.", run.stdout)


def test_grads_writes_per_example_gradients_of_a_dataset(served, tmp_path: Path) -> None:
    _, target = served
    rng = np.random.default_rng(0)
    x = rng.random((10, 784), dtype=np.float32)
    y = rng.integers(0, 10, 10)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    run = _grads(
        target, "mnist_mlp", tmp_path / "data.npz", tmp_path / "g.npz", "--batch-size", "4"
    )
    assert run.returncode == 0, run.stderr
    assert "wrote" in run.stdout and "10 examples, 5 arrays (none)" in run.stdout
    written = np.load(tmp_path / "g.npz")
    with GradientClient(target) as client:
        direct = client.per_example_gradients("mnist_mlp", x, y)
    np.testing.assert_allclose(
        written["grad/hidden/kernel"], direct.gradients["hidden/kernel"], rtol=1e-5, atol=1e-7
    )
    assert written["losses"].shape == (10,)


def test_grads_file_matches_keras_oracle(served, tmp_path: Path) -> None:
    """Every example's loss and gradient, written in batches of 4, under the file's names."""
    _, target = served
    rng = np.random.default_rng(2)
    x, y = rng.random((6, 784), dtype=np.float32), rng.integers(0, 10, 6)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    out = tmp_path / "g.npz"
    run = _grads(target, "mnist_mlp", tmp_path / "data.npz", out, "--batch-size", "4", "--quiet")
    assert run.returncode == 0, run.stderr
    written = np.load(out)
    losses, grads = oracle.per_example(BUILTIN_MODELS["mnist_mlp"](), LOSS, x, y)
    assert_close({"losses": written["losses"]}, {"losses": losses})
    written_grads = {k.removeprefix("grad/"): written[k] for k in written if k.startswith("grad/")}
    assert_close(written_grads, grads)


def test_grads_writes_server_side_norms_and_projections(served, tmp_path: Path) -> None:
    _, target = served
    rng = np.random.default_rng(1)
    x, y = rng.random((6, 784), dtype=np.float32), rng.integers(0, 10, 6)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    with GradientClient(target) as client:
        direct = client.per_example_gradients("mnist_mlp", x, y)
    for reduction in ("norms", "project"):
        out = tmp_path / f"{reduction}.npz"
        run = _grads(
            target,
            "mnist_mlp",
            tmp_path / "data.npz",
            out,
            "--batch-size",
            "4",
            "--reduction",
            reduction,
            "--dim",
            "8",
            "--quiet",
        )
        assert run.returncode == 0, run.stderr
        written = np.load(out)
        assert "grad/hidden/kernel" not in written
    np.testing.assert_allclose(
        np.load(tmp_path / "norms.npz")["norms"], direct.gradient_norms(), rtol=1e-5
    )
    assert np.load(tmp_path / "project.npz")["projections"].shape == (6, 8)


def test_unknown_model_fails_with_the_server_message(served, tmp_path: Path) -> None:
    _, target = served
    np.savez(tmp_path / "d.npz", x=np.zeros((1, 784)), y=np.zeros(1, int))
    run = _grads(target, "nope", tmp_path / "d.npz", tmp_path / "o.npz", "--quiet")
    assert run.returncode == 1
    assert "NOT_FOUND: model 'nope' not found" in run.stderr


def test_serve_refuses_a_bad_flag_with_exit_2() -> None:
    run = _run("serve", "--port", "99999")
    assert run.returncode == 2
    assert "--port must be in [0, 65535]" in run.stderr


def test_sigterm_drains_and_exits_zero() -> None:
    """A server of its own, so that the other tests keep theirs whatever the order."""
    process, target = spawn_server("--model", "mnist_mlp", "--jit-compile", "off")
    try:
        assert _run("info", "--target", target).returncode == 0
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        stop_server(process)


def test_step_trains_on_the_server_over_the_file(fresh_server, tmp_path: Path) -> None:
    """Two plain SGD steps of 4 examples (--reduction moments, the mean): the weights the
    oracle's per-example gradients give, and a line per epoch."""
    target = f"127.0.0.1:{fresh_server.port}"
    rng = np.random.default_rng(4)
    x, y = rng.random((8, 784), dtype=np.float32), rng.integers(0, 10, 8)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    with GradientClient(target) as client:
        _, weights = client.get_weights("mnist_mlp")
    flags = ["--model", "mnist_mlp", "--data", str(tmp_path / "data.npz"), "--batch-size", "4"]
    run = _run(
        "step", "--target", target, *flags, "--learning-rate", "0.1", "--reduction", "moments"
    )
    assert run.returncode == 0, run.stderr
    assert re.search(r"epoch 1: version 3, mean loss \d+\.\d{4}, clipped 0 of 8", run.stdout)
    model = BUILTIN_MODELS["mnist_mlp"]()
    for part in (slice(0, 4), slice(4, 8)):
        _, grads = oracle.per_example(model, LOSS, x[part], y[part], weights=weights)
        weights = {name: w - 0.1 * grads[name].mean(axis=0) for name, w in weights.items()}
    with GradientClient(target) as client:
        _, served = client.get_weights("mnist_mlp")
        assert f"weights_id {client.model_info('mnist_mlp').weights_id}" in run.stdout
    assert_close(served, weights)
