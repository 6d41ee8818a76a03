"""Shared fixtures: real servers on 127.0.0.1 (port 0), real clients, reference models."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys

import tomllib

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pergrad.client import GradientClient

if TYPE_CHECKING:
    from pergrad.server.main import RunningServer

# xdist's controller imports this file too and runs no test: what loads TensorFlow (7 s
# here, before any worker starts) is imported inside the fixtures that need it.

ROOT = Path(__file__).resolve().parent.parent


def package_dir() -> dict[str, str]:
    """Import name -> folder, as pyproject.toml maps them (setup.py ships what they hold)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["package-dir"]


# What a copy of the checkout for building leaves out: git's, the environments', and
# earlier builds' files (a stale build/ could put files into the wheel the tree lacks).
NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"
)


@contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    """Held by one process at a time: the xdist workers of a run share what it guards."""
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _run_dir(factory: pytest.TempPathFactory) -> Path:
    """A temporary directory of this run, shared by its xdist workers."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """pergrad-*.whl built as `make wheel` builds it (pip wheel, no deps, no isolation),
    from a copy of the checkout into this run's temporary directory, once per run: what
    users and the Dockerfiles install, without touching the checkout's build/ or dist/."""
    run = _run_dir(tmp_path_factory)
    with _exclusive(run / "wheel.lock"):
        out = run / "wheel"
        if not out.is_dir():
            source = run / "wheel-source"
            shutil.copytree(ROOT, source, ignore=NOT_SOURCES, symlinks=True)
            command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps"]
            subprocess.run(
                [*command, "--no-build-isolation", "-w", run / "wheel-partial", source],
                check=True,
                timeout=600,
            )
            (run / "wheel-partial").rename(out)  # whole or absent, for the next worker
        (built,) = out.glob("pergrad-*.whl")
    return built


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers import KERAS_MODEL_NAME, tabular_model

    directory = tmp_path_factory.mktemp("models")
    tabular_model().save(directory / f"{KERAS_MODEL_NAME}.keras")
    return directory


def _start(model_dir: Path, *models: str) -> RunningServer:
    from pergrad.server.main import start
    from tests.helpers import loopback_config

    return start(loopback_config(*models, model_dir=model_dir, max_batch=512))


@pytest.fixture(scope="session")
def server(model_dir: Path) -> Iterator[RunningServer]:
    """One server for read-only tests: both built-ins and the .keras model."""
    from tests.helpers import KERAS_MODEL_NAME

    running = _start(model_dir, "mnist_mlp", "mnist_cnn", f"{KERAS_MODEL_NAME}.keras")
    yield running
    running.stop(0)


@pytest.fixture()
def fresh_server(model_dir: Path) -> Iterator[RunningServer]:
    """A server of its own for tests that change weights."""
    running = _start(model_dir, "mnist_mlp")
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


@pytest.fixture()
def servers() -> Iterator[list[RunningServer]]:
    """Servers a test starts (`tests.pauses.gated_server`, say), stopped after it."""
    running: list[RunningServer] = []
    yield running
    for server in running:
        server.stop(0)
