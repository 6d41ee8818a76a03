"""The release, run the way users run it.

With nothing but the wheel installed, from a working directory outside the checkout: the
server starts from the Dockerfiles' own ENTRYPOINT and CMD (and their ENV), answers their
HEALTHCHECK command, `pergrad info`, and a gradients call with every reduction the wire
contract names, then drains and exits 0 on SIGTERM.

`make image-test` runs the same tests against a container of the CPU image as well
(PERGRAD_IMAGE names it; the image's own entry point starts the server).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pergrad.v1 import gradient_service_pb2 as pb
from tests.conftest import ROOT
from tests.release.conftest import Installed

DOCKERFILES = sorted((ROOT / "deploy" / "docker").glob("Dockerfile.*"))
READY = re.compile(r"pergrad ready on (\S+):(\d+)")
REDUCTIONS = [name.removeprefix("REDUCTION_").lower() for name in pb.Reduction.keys()]  # noqa: SIM118 - an enum wrapper
MODELS = ("mnist_mlp", "mnist_cnn")
SMOKE = Path(__file__).with_name("every_reduction.py")
# What the server is told beyond the image's own ENV: loopback, free ports, two models.
SERVER_ENV = {
    "PERGRAD_HOST": "127.0.0.1",
    "PERGRAD_PORT": "0",
    "PERGRAD_METRICS_PORT": "0",
    "PERGRAD_MODELS": ",".join(MODELS),
}
IMAGE = os.environ.get("PERGRAD_IMAGE")
PODMAN_ENV = {
    "CONTAINERS_CONF": os.environ.get(
        "CONTAINERS_CONF", str(ROOT / "deploy" / "docker" / "podman" / "containers.conf")
    )
}


def _instruction(dockerfile: Path, name: str) -> str:
    """The arguments of the last `name` instruction, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    found = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith(name + " ")]
    return found[-1]


def _exec_form(dockerfile: Path, name: str) -> list[str]:
    args = _instruction(dockerfile, name)
    return json.loads(args[args.index("[") :])


def _image_env(dockerfile: Path) -> dict[str, str]:
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    lines = [line.split(None, 1)[1] for line in text.splitlines() if line.startswith("ENV ")]
    return dict(item.split("=", 1) for line in lines for item in line.split())


@dataclass
class Served:
    """A running server and how to run a command beside it, where its users would."""

    process: subprocess.Popen
    port: int
    log: list[str]
    run: Callable[..., subprocess.CompletedProcess]
    smoke: str  # the every-reduction script's path where `run` runs
    foreign: Path  # modules must not come from here (the checkout)


def _wait_ready(process: subprocess.Popen, command: list[str]) -> tuple[int, list[str]]:
    log: list[str] = []
    for line in process.stderr:
        log.append(line)
        if match := READY.search(line):
            threading.Thread(target=lambda: log.extend(process.stderr), daemon=True).start()
            return int(match.group(2)), log
    pytest.fail(f"{command} exited {process.wait()}:\n{''.join(log[-20:])}")


def _from_wheel(installed: Installed, outside: Path) -> Iterator[Served]:
    dockerfile = DOCKERFILES[0]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PERGRAD_"))}
    env = installed.env({**base, **_image_env(dockerfile)}, **SERVER_ENV)
    command = _exec_form(dockerfile, "ENTRYPOINT") + _exec_form(dockerfile, "CMD")
    process = subprocess.Popen(command, cwd=outside, env=env, stderr=subprocess.PIPE, text=True)
    port, log = _wait_ready(process, command)

    def run(*argv: str, **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            argv, cwd=outside, env={**env, **extra}, capture_output=True, text=True, timeout=300
        )

    yield Served(process, port, log, run, str(SMOKE), ROOT)


def _from_image(image: str) -> Iterator[Served]:
    name = f"pergrad-smoke-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, **PODMAN_ENV}
    flags = [f"--env={key}={value}" for key, value in SERVER_ENV.items()]
    command = [
        "podman", "run", "--rm", f"--name={name}", "--network=host",
        f"--volume={SMOKE}:/smoke/{SMOKE.name}:ro", *flags, image,
    ]  # fmt: skip
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    port, log = _wait_ready(process, command)

    def run(*argv: str, **extra: str) -> subprocess.CompletedProcess:
        exported = [f"--env={key}={value}" for key, value in extra.items()]
        return subprocess.run(
            ["podman", "exec", *exported, name, *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    yield Served(process, port, log, run, f"/smoke/{SMOKE.name}", ROOT)
    subprocess.run(["podman", "rm", "-f", name], env=env, capture_output=True, timeout=120)


DEPLOYMENTS = ["wheel", *(["image"] if IMAGE else [])]


def _deploy(
    kind: str, installed: Installed, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    if kind == "image":
        deployments = _from_image(IMAGE)
    else:
        deployments = _from_wheel(installed, tmp_path_factory.mktemp("outside"))
    served = next(deployments)
    yield served
    if served.process.poll() is None:
        served.process.kill()
        served.process.wait()
    next(deployments, None)


@pytest.fixture(scope="module", params=DEPLOYMENTS)
def served(
    request: pytest.FixtureRequest, installed: Installed, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    yield from _deploy(request.param, installed, tmp_path_factory)


@pytest.fixture(params=DEPLOYMENTS)
def own_served(
    request: pytest.FixtureRequest, installed: Installed, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """A deployment of the test's own, for a test that stops it."""
    yield from _deploy(request.param, installed, tmp_path_factory)


def test_the_server_runs_the_installed_modules(served: Served) -> None:
    run = served.run("python", "-c", "import pergrad.server.engine as e; print(e.__file__)")
    assert run.returncode == 0, run.stderr
    assert not Path(run.stdout.strip()).is_relative_to(served.foreign)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.suffix[1:])
def test_dockerfile_healthcheck_reports_serving(served: Served, dockerfile: Path) -> None:
    run = served.run(*_exec_form(dockerfile, "HEALTHCHECK"), PERGRAD_PORT=str(served.port))
    assert (run.returncode, run.stderr.strip()) == (0, "SERVING")


def test_pergrad_info_describes_every_served_model(served: Served) -> None:
    run = served.run("pergrad", "info", "--target", f"127.0.0.1:{served.port}")
    assert run.returncode == 0, run.stderr
    for model in MODELS:
        assert re.search(rf"^{model}  version 1  [\d,]+ parameters$", run.stdout, re.M)


@pytest.mark.parametrize("model", MODELS)
def test_every_reduction_answers_through_the_installed_client(served: Served, model: str) -> None:
    run = served.run("python", served.smoke, f"127.0.0.1:{served.port}", model, *REDUCTIONS)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert sorted(report) == sorted(REDUCTIONS)
    for reduction, fields in report.items():
        assert fields["losses"] == [5], reduction


def test_sigterm_drains_and_exits_zero(own_served: Served) -> None:
    own_served.process.send_signal(signal.SIGTERM)
    assert own_served.process.wait(timeout=90) == 0
    assert not [line for line in own_served.log if "Traceback" in line], "".join(own_served.log)
