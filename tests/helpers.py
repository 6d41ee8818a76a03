"""Helpers the tests share: the tolerance contract, reference models, random batches."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

from pergrad.client.local import LocalServer
from pergrad.server.config import AUTO_COALESCED_BATCH, Config
from pergrad.server.engine.group import shared_rows

# float32 results of the vectorized pass and of the batch-size-1 loop sum the same terms in
# different orders (and oneDNN picks different kernels per batch size), so they differ by
# a few ulps of the tensor's largest entry; 1e-5 of that scale (~84 float32 epsilons) is
# the contract. Against the loop in float64, a float32 result also carries the float32
# rounding the model's conditioning amplifies, which no float32 computation escapes: the
# float32 loop's own error on the same tensor measures it, and a result is held to
# LOOP_ERROR_FACTOR times that error where it exceeds the contract (`float64_tolerances`).
# The README's Engine section states both; tests/test_readme.py holds it to these numbers.
RELATIVE_TOLERANCE = 1e-5
LOOP_ERROR_FACTOR = 2

# The line a server logs once it answers: its gRPC target and its metrics port.
READY = re.compile(r"pergrad ready on (\S+:\d+) .* metrics on http://\S+:(\d+)/metrics")
KERAS_MODEL_NAME = "tabular"


def float64_tolerances(
    float32_loop: Mapping[str, np.ndarray], float64_loop: Mapping[str, np.ndarray]
) -> dict[str, float]:
    """Per tensor, how close a float32 result must be to the float64 loop's: within
    max(1e-5, 2 e) of its scale, e the float32 loop's own error there."""
    errors = relative_errors(float32_loop, float64_loop)
    return {
        name: max(RELATIVE_TOLERANCE, LOOP_ERROR_FACTOR * error) for name, error in errors.items()
    }


def assert_close(
    actual: Mapping[str, np.ndarray],
    expected: Mapping[str, np.ndarray],
    tolerance: float | Mapping[str, float] = RELATIVE_TOLERANCE,
) -> None:
    """Every tensor within `tolerance` (one for all, or one per tensor) of its reference's
    scale; lists all misses.

    A tensor whose true value is zero holds only rounding noise (attention's key bias:
    softmax ignores a shift shared by all keys), so no scale is taken below 1e-2 of the
    largest reference entry of all the tensors compared.
    """
    bounds = tolerance if isinstance(tolerance, Mapping) else dict.fromkeys(expected, tolerance)
    misses = [
        f"{name}: relative error {error:.2e} over {bounds[name]:.1e}"
        for name, error in relative_errors(actual, expected).items()
        if not error <= bounds[name]  # a NaN is a miss (NaN > bound is False)
    ]
    assert not misses, "; ".join(misses)


def relative_errors(
    actual: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray]
) -> dict[str, float]:
    """Each tensor's largest error relative to its reference's scale (see assert_close)."""
    assert actual.keys() == expected.keys()
    floor = 1e-2 * max(float(np.max(np.abs(want))) for want in expected.values())
    errors = {}
    for name, want in expected.items():
        got = actual[name]
        assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
        scale = max(float(np.max(np.abs(want))), floor) or 1.0
        errors[name] = float(np.max(np.abs(got.astype(np.float64) - want))) / scale
    return errors


def tabular_model() -> keras.Model:
    """A functional model with a nested Sequential block and a compiled loss."""
    init = keras.initializers.GlorotUniform
    inputs = keras.Input((12,), name="features")
    block = keras.Sequential(
        [
            keras.layers.Dense(16, activation="tanh", kernel_initializer=init(7), name="d1"),
            keras.layers.Dense(8, activation="gelu", kernel_initializer=init(8), name="d2"),
        ],
        name="block",
    )
    hidden = block(inputs)
    outputs = keras.layers.Dense(5, kernel_initializer=init(9), name="head")(hidden)
    model = keras.Model(inputs, outputs, name=KERAS_MODEL_NAME)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def batch_for(shape: tuple[int, ...], classes: int, size: int, seed: int = 0):
    """Random float inputs [size, *shape] and class labels in [0, classes)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((size, *shape)).astype(np.float32)
    y = rng.integers(0, classes, size=size).astype(np.int32)
    return x, y


def connect_both(client: Any, model: str, x: Any, y: Any) -> None:
    """Call a two-replica client (one example a call: one replica each) until both
    replicas have answered: round_robin picks only the replicas it has connected to, and
    under load the second may connect several calls after the first; from then on
    micro-batches go to both."""
    seen: set[str] = set()
    deadline = time.monotonic() + 30
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only {seen} answered in 30 s"
        seen.add(client.per_example_gradients(model, x[:1], y[:1], reduction="norms").server)


def spawn_server(*flags: str) -> tuple[subprocess.Popen, str]:
    """`pergrad serve` in a process of its own on 127.0.0.1, port 0: (process, target)."""
    server = LocalServer(*flags)
    return server.process, server.target


def stop_server(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)


# The open services' methods (no token needed), each with whether it takes a stream of
# requests.
OPEN_METHODS = [
    ("/grpc.health.v1.Health/Check", False),
    ("/grpc.health.v1.Health/Watch", False),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", True),
]


def open_call(channel: Any, method: str, streaming: bool, data: bytes) -> Any:
    """A call to an open service's `method` (OPEN_METHODS) sending `data` as its one
    request, its responses to iterate."""
    if streaming:
        return channel.stream_stream(method)(iter([data]), timeout=30)
    return channel.unary_stream(method)(data, timeout=30)


def loopback_config(*models: str, **settings: object) -> Config:
    """A test server's config: 127.0.0.1, free ports, no XLA timing, these models, and
    small requests sharing passes as they do by default where a GPU is seen (off by default
    on a CPU): the suite's calls take the shared path, whose results must not depend on
    what shares a pass."""
    return Config(
        **{
            "host": "127.0.0.1",
            "port": 0,
            "metrics_port": 0,
            "jit_compile": "off",
            "max_coalesced_batch": AUTO_COALESCED_BATCH,
            "models": models,
            **settings,
        }
    )


def installed_tool(name: str, how: str) -> str:
    """Path of a command-line tool the suite needs: beside this Python (where `make test`
    installs it into .venv) or else on PATH. Its absence fails the test, saying `how` to
    get it: every one of them can be installed, so a missing one is a broken setup."""
    beside_python = Path(sys.executable).with_name(name)
    path = str(beside_python) if beside_python.exists() else shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not installed: {how}", pytrace=False)
    return path


def computed_together(engine, jobs, **passes) -> list:
    """Each job's result or error, as the coalescer's callers get them: the shared passes'
    rows (`group.shared_rows`), each then fed to its own job's sink (`Rows.into`)."""
    outcomes = []
    for job, rows in zip(jobs, shared_rows(engine, jobs, **passes), strict=True):
        try:
            outcomes.append(rows if isinstance(rows, Exception) else rows.into(job.sink))
        except Exception as err:
            outcomes.append(err)
    return outcomes
