"""`pergrad serve` in a process of its own: flags refused before TensorFlow loads, SIGTERM
drains (while starting too), a stop that hangs exits 1 with every thread's stack."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pergrad.client import GradientClient, GradientResult
from tests.helpers import READY, batch_for

BAD_FLAG = """
import sys
from pergrad.server.serve import serve
code = serve(sys.argv[1:])
assert "tensorflow" not in sys.modules, "TensorFlow loaded before the flags were checked"
sys.exit(code)
"""


def test_a_bad_flag_is_refused_with_exit_2_before_tensorflow_loads() -> None:
    run = subprocess.run(
        [sys.executable, "-c", BAD_FLAG, "--port", "99999"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, run.stderr
    assert "pergrad serve: --port must be in [0, 65535]" in run.stderr


class _Serve:
    """`pergrad serve` in a process of its own, with its log kept."""

    def __init__(self, *flags: str) -> None:
        command = [sys.executable, "-m", "pergrad.cli", "serve", *flags]
        self.process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []
        match = None
        for line in self.process.stderr:
            self.log.append(line)
            if match := READY.search(line):
                break
        assert match, "server never logged its ready line:\n" + "".join(self.log)
        self.target, self.metrics_port = match.group(1), int(match.group(2))
        threading.Thread(target=self._keep_log, daemon=True).start()

    def _keep_log(self) -> None:
        self.log.extend(self.process.stderr)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


@pytest.fixture()
def serving(tmp_path: Path) -> Iterator[_Serve]:
    flags = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--grace", "30"]
    served = _Serve(*flags, "--model", "mnist_mlp", "--jit-compile", "off")
    yield served
    served.close()


def _watch_health(target: str) -> tuple[grpc.Channel, Iterator[health_pb2.HealthCheckResponse]]:
    channel = grpc.insecure_channel(target)
    updates = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    return channel, updates


def test_sigterm_drains_a_request_in_flight_then_exits_zero(serving: _Serve) -> None:
    """The request spans the signal: one batch before it, three after NOT_SERVING."""
    batches = [batch_for((784,), 10, size, seed=size) for size in (64, 32, 16, 8)]
    first_result, resume = threading.Event(), threading.Event()
    results: list[GradientResult] = []

    def feed() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        yield batches[0]
        resume.wait(60)
        yield from batches[1:]

    def request() -> None:
        with GradientClient(serving.target, timeout=60) as client:
            for result in client.stream("mnist_mlp", feed(), timeout=120):
                results.append(result)
                first_result.set()

    channel, health = _watch_health(serving.target)
    with channel:
        assert next(health).status == health_pb2.HealthCheckResponse.SERVING
        caller = threading.Thread(target=request)
        caller.start()
        assert first_result.wait(60), "".join(serving.log)
        serving.process.send_signal(signal.SIGTERM)
        assert next(health).status == health_pb2.HealthCheckResponse.NOT_SERVING
        health.cancel()
    resume.set()
    caller.join(timeout=120)
    assert [r.batch_size for r in results] == [64, 32, 16, 8]
    assert all(np.isfinite(r.losses).all() for r in results)
    assert serving.process.wait(timeout=60) == 0, "".join(serving.log)


def test_sigterm_while_starting_drains_and_exits_zero() -> None:
    """A stop that arrives before the server is ready (a pod deleted as it starts, or just
    as it turns ready) is a drain and a clean exit, never death by the signal."""
    command = [
        sys.executable, "-m", "pergrad.cli", "serve", "--host", "127.0.0.1", "--port", "0",
        "--metrics-port", "0", "--model", "mnist_mlp", "--jit-compile", "off",
    ]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    log = []
    for line in process.stderr:  # it names its devices before it loads the models
        log.append(line)
        if "devices:" in line:
            process.send_signal(signal.SIGTERM)
            break
    log.extend(process.stderr)
    assert process.wait(timeout=120) == 0, "".join(log)
    assert "stopped" in log[-1], "".join(log)


SIGNAL_TO_ANOTHER_THREAD = """
import signal, sys, threading, time
from pergrad.server import serve

def aim():
    # Once the server has started (its stall watcher runs), SIGTERM goes to this thread,
    # as the kernel may deliver it to any thread of the process.
    while not any(t.name == "pergrad-stalls" for t in threading.enumerate()):
        time.sleep(0.1)
    time.sleep(1.0)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

threading.Thread(target=aim, daemon=True).start()
sys.exit(serve.serve(sys.argv[1:]))
"""


def test_sigterm_delivered_to_another_thread_still_drains() -> None:
    """Before: the main thread waited for the stop without a timeout, so a SIGTERM the
    kernel handed to another thread was never acted on, and the server hung (found as a
    loaded run's LocalServer killed after 60 s with no "draining" line in its log)."""
    flags = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--grace", "0"]
    command = [sys.executable, "-c", SIGNAL_TO_ANOTHER_THREAD, *flags, "--model", "mnist_mlp"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "draining" in done.stderr and "stopped" in done.stderr


HANGING_STOP = """
import sys, threading
from pergrad.server import main, serve
serve.STOP_SLACK_S = 1.0
main.RunningServer.stop = lambda self, grace_s: threading.Event().wait()
sys.exit(serve.serve(sys.argv[1:]))
"""


def test_a_stop_that_hangs_prints_every_threads_stack_and_exits_1() -> None:
    flags = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--grace", "0"]
    command = [sys.executable, "-c", HANGING_STOP, *flags, "--model", "mnist_mlp"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        ready = any(READY.search(line) for line in process.stderr)
        assert ready, "the server exited before it served"
        process.send_signal(signal.SIGTERM)
        log = process.stderr.read()
        assert process.wait(timeout=60) == 1
    finally:
        process.kill()
    assert "Timeout (0:00:01)!" in log and "Thread 0x" in log and "in serve" in log
