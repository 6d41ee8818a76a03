"""A `pergrad serve` process on this machine, for scripts, examples and tests.

    with LocalServer("--model", "mnist_cnn") as server:
        with GradientClient(server.target) as client: ...

Needs `pergrad[server]` installed; the client itself still imports no TensorFlow (the
server runs in a child process).
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from types import TracebackType

READY = re.compile(r"pergrad ready on (\S+:\d+)")


class LocalServer:
    """Starts `pergrad serve --host 127.0.0.1 --port 0 --metrics-port 0 FLAGS...` and
    waits for its ready line; the log is drained in a thread so the child never blocks."""

    def __init__(self, *flags: str) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pergrad.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--metrics-port",
                "0",
                *flags,
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        log: list[str] = []
        for line in self.process.stderr:
            if match := READY.search(line):
                self.target = match.group(1)
                threading.Thread(target=self.process.stderr.read, daemon=True).start()
                return
            log.append(line)
        status = self.process.wait()
        raise RuntimeError(f"pergrad serve exited with {status}:\n{''.join(log[-5:])}")

    def stop(self, *, graceful: bool = True) -> int:
        """SIGTERM (drain, then exit) or SIGKILL; returns the exit status."""
        if self.process.poll() is None:
            (self.process.terminate if graceful else self.process.kill)()
        return self.process.wait(timeout=60)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
