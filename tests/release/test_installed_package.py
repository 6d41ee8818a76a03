"""The installed wheel, run the way users run it.

From a working directory outside the checkout, with nothing but the wheel installed: the
server starts from the Dockerfiles' own ENTRYPOINT and CMD (and their ENV), answers their
HEALTHCHECK command, `pergrad info`, and a gradients call with every reduction the wire
contract names, then drains and exits 0 on SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from collections.abc import Iterator
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
    process: subprocess.Popen
    port: int
    env: dict[str, str]
    cwd: Path
    log: list[str]


@pytest.fixture(scope="module")
def served(installed: Installed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    dockerfile = DOCKERFILES[0]
    outside = tmp_path_factory.mktemp("outside")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PERGRAD_"))}
    env = installed.env(
        {**base, **_image_env(dockerfile)},
        PERGRAD_HOST="127.0.0.1",
        PERGRAD_PORT="0",
        PERGRAD_METRICS_PORT="0",
        PERGRAD_MODELS=",".join(MODELS),
    )
    command = _exec_form(dockerfile, "ENTRYPOINT") + _exec_form(dockerfile, "CMD")
    process = subprocess.Popen(command, cwd=outside, env=env, stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    for line in process.stderr:
        log.append(line)
        if match := READY.search(line):
            threading.Thread(target=lambda: log.extend(process.stderr), daemon=True).start()
            break
    else:
        pytest.fail(f"{command} exited {process.wait()}:\n{''.join(log[-20:])}")
    served = Served(process, int(match.group(2)), env, outside, log)
    yield served
    if process.poll() is None:
        process.kill()
        process.wait()


def _run(served: Served, *argv: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv,
        cwd=served.cwd,
        env={**served.env, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_server_runs_the_installed_modules(served: Served, installed: Installed) -> None:
    run = _run(served, "python", "-c", "import pergrad.server.engine as e; print(e.__file__)")
    assert run.returncode == 0, run.stderr
    assert Path(run.stdout.strip()).is_relative_to(installed.prefix)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.suffix[1:])
def test_dockerfile_healthcheck_reports_serving(served: Served, dockerfile: Path) -> None:
    command = _exec_form(dockerfile, "HEALTHCHECK")
    run = _run(served, *command, PERGRAD_PORT=str(served.port))
    assert (run.returncode, run.stderr.strip()) == (0, "SERVING")


def test_pergrad_info_describes_every_served_model(served: Served) -> None:
    run = _run(served, "pergrad", "info", "--target", f"127.0.0.1:{served.port}")
    assert run.returncode == 0, run.stderr
    for model in MODELS:
        assert re.search(rf"^{model}  version 1  [\d,]+ parameters$", run.stdout, re.M)


@pytest.mark.parametrize("model", MODELS)
def test_every_reduction_answers_through_the_installed_client(served: Served, model: str) -> None:
    script = Path(__file__).with_name("every_reduction.py")
    target = f"127.0.0.1:{served.port}"
    run = _run(served, "python", str(script), target, model, *REDUCTIONS)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert sorted(report) == sorted(REDUCTIONS)
    for reduction, fields in report.items():
        assert fields["losses"] == [5], reduction


def test_sigterm_drains_and_exits_zero(served: Served) -> None:
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=60) == 0
    assert not [line for line in served.log if "Traceback" in line], "".join(served.log)
