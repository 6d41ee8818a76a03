"""Shared fixtures: real servers on 127.0.0.1 (port 0), real clients, reference models."""

from __future__ import annotations

import os
import subprocess

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from collections.abc import Iterator
from pathlib import Path

import pytest

from pergrad.client import GradientClient
from pergrad.server.config import Config
from pergrad.server.main import RunningServer, start
from tests.helpers import KERAS_MODEL_NAME, loopback_config, tabular_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def wheel() -> Path:
    """dist/pergrad-*.whl, built by `make wheel`: what users and the Dockerfiles install."""
    subprocess.run(["make", "-s", "wheel"], cwd=ROOT, check=True, timeout=600)
    (built,) = (ROOT / "dist").glob("pergrad-*.whl")
    return built


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("models")
    tabular_model().save(directory / f"{KERAS_MODEL_NAME}.keras")
    return directory


def _config(model_dir: Path, *models: str) -> Config:
    return loopback_config(*models, model_dir=model_dir, max_batch=512)


@pytest.fixture(scope="session")
def server(model_dir: Path) -> Iterator[RunningServer]:
    """One server for read-only tests: both built-ins and the .keras model."""
    running = start(_config(model_dir, "mnist_mlp", "mnist_cnn", f"{KERAS_MODEL_NAME}.keras"))
    yield running
    running.stop(0)


@pytest.fixture()
def fresh_server(model_dir: Path) -> Iterator[RunningServer]:
    """A server of its own for tests that change weights."""
    running = start(_config(model_dir, "mnist_mlp"))
    yield running
    running.stop(0)


@pytest.fixture()
def client(server: RunningServer) -> Iterator[GradientClient]:
    with GradientClient(f"127.0.0.1:{server.port}", timeout=60) as c:
        yield c


@pytest.fixture()
def fresh_client(fresh_server: RunningServer) -> Iterator[GradientClient]:
    with GradientClient(f"127.0.0.1:{fresh_server.port}", timeout=60) as c:
        yield c
