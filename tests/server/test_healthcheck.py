"""The container's health check against real servers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from pergrad.server.healthcheck import main
from pergrad.server.main import RunningServer


def test_exits_zero_for_a_serving_server(server: RunningServer) -> None:
    assert main(["--target", f"127.0.0.1:{server.port}"]) == 0


def test_exits_one_for_a_draining_server(fresh_server: RunningServer) -> None:
    fresh_server.health.stop_serving()
    assert main(["--target", f"127.0.0.1:{fresh_server.port}"]) == 1


def test_exits_one_when_nothing_listens() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["--target", f"127.0.0.1:{port}", "--timeout", "1"]) == 1


def test_module_checks_the_port_from_the_environment(server: RunningServer) -> None:
    """As the Dockerfile's HEALTHCHECK runs it: no flags, PERGRAD_PORT set."""
    run = subprocess.run(
        [sys.executable, "-m", "pergrad.server.healthcheck"],
        env={**os.environ, "PERGRAD_PORT": str(server.port)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert run.stderr.strip() == "SERVING"
