"""The release as users get it: the wheel `make wheel` builds, installed outside the checkout.

The installed environment is a fresh virtualenv holding only the wheel; the dependencies
come from the test run's own environment through a path entry (not its .pth files, so the
checkout's editable install is not visible there). Anything missing from the wheel then
fails to import, as it would for a user.
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Installed:
    """A virtualenv holding the wheel; `bin` first on PATH runs the installed commands."""

    prefix: Path

    @property
    def bin(self) -> Path:
        return self.prefix / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"

    def env(self, base: dict[str, str], **extra: str) -> dict[str, str]:
        return {**base, "PATH": f"{self.bin}:{base.get('PATH', '')}", **extra}


@pytest.fixture(scope="session")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    prefix = tmp_path_factory.mktemp("installed") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", prefix], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)}))
    (site / "_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    env = Installed(prefix)
    subprocess.run(
        [env.python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel],
        check=True,
        timeout=300,
    )
    yield env
