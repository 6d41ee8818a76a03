"""Helpers of the example tests: a fresh server, and running an example as a user does."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from pergrad.server.main import start
from tests.helpers import loopback_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@contextlib.contextmanager
def fresh_target() -> Iterator[str]:
    """A server of its own on 127.0.0.1 (port 0) with both built-in digit models: the
    examples train, so each gets the initial weights (and the SGD with momentum that
    `dp_sgd.py` starts its own server with)."""
    config = loopback_config("mnist_mlp", "mnist_cnn", max_batch=512, optimizer="sgd:momentum=0.9")
    running = start(config)
    try:
        yield f"127.0.0.1:{running.port}"
    finally:
        running.stop(0)


def run_example(name: str, *args: str) -> dict[str, str]:
    """Runs examples/NAME.py in a process of its own; returns its closing summary lines."""
    run = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert "summary" in lines, run.stdout
    return dict(line.split(": ", 1) for line in lines[lines.index("summary") + 1 :])
