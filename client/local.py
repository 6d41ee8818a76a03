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
from collections import deque
from types import TracebackType

READY = re.compile(
    r"pergrad ready on ((\S+):\d+).* \(health and reflection on port (\d+)\).* metrics on "
    r"(http://\S+)"
)
# The server drains for --grace (10 s by default) and exits within 20 s after it.
STOP_TIMEOUT_S = 60.0
LOG_TAIL = 1000


class LocalServer:
    """Starts `pergrad serve --host 127.0.0.1 --port 0 --metrics-port 0 FLAGS...` and
    waits for its ready line (`target`, `health_target`: where health and reflection
    answer, `metrics_url`); the log is drained in a thread so the child never blocks."""

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
        self.log: deque[str] = deque(maxlen=LOG_TAIL)
        assert self.process.stderr is not None  # stderr=PIPE
        for line in self.process.stderr:
            if match := READY.search(line):
                self.target, self.metrics_url = match.group(1), match.group(4)
                self.health_target = f"{match.group(2)}:{match.group(3)}"
                self._reader = threading.Thread(
                    target=self.log.extend, args=(self.process.stderr,), daemon=True
                )
                self._reader.start()
                return
            self.log.append(line)
        status = self.process.wait()
        raise RuntimeError(f"pergrad serve exited with {status}:\n{''.join(list(self.log)[-5:])}")

    def stop(self, *, graceful: bool = True) -> int:
        """SIGTERM (drain, then exit) or SIGKILL; returns the exit status. A server that
        does not exit 0 after SIGTERM raises, with the end of its log (a stop that hangs
        prints every thread's stack there, `pergrad.server.serve.STOP_SLACK_S`)."""
        if self.process.poll() is not None:
            return self.process.returncode
        (self.process.terminate if graceful else self.process.kill)()
        try:
            status = self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            status = self.process.wait()
        if graceful and status != 0:
            self._reader.join(timeout=5)  # the log's last lines
            raise RuntimeError(
                f"pergrad serve exited with {status} after SIGTERM; its log ends:\n"
                + "".join(self.log)
            )
        return status

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
