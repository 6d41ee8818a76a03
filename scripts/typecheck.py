"""`make lint`'s type check: mypy over the package as it installs, its errors named by
the source files they are in.

The import names map to top-level folders (`pyproject.toml`'s
`[tool.setuptools.package-dir]`: `pergrad.server` is `server/`), which mypy cannot
follow, and the editable install's import hook is invisible to it. So the package's
layout is laid out as the wheel lays it, as symlinks under build/typecheck/, from that
table itself; mypy checks it there with the settings in `[tool.mypy]`, and each error's
path is written back as the source path.

    python scripts/typecheck.py [package ...]   (default: CHECKED)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"
# Every package but the generated protobuf modules; `[tool.mypy]` says how strictly.
CHECKED = ("pergrad.client", "pergrad.wire", "pergrad.cli", "pergrad.server")


def package_dirs() -> dict[str, Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = config["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in folders.items()}


def lay_out(tree: Path) -> dict[Path, Path]:
    """The installed layout under `tree`, as symlinks; {link: source folder}."""
    links: dict[Path, Path] = {}
    for name, folder in sorted(package_dirs().items()):
        target = tree.joinpath(*name.split("."))
        if target.parent != tree:
            links[target] = folder
            continue
        target.mkdir(parents=True, exist_ok=True)
        for entry in folder.iterdir():  # the root package: its files, beside the others
            links[target / entry.name] = entry
    for link, source in links.items():
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(source, target_is_directory=source.is_dir())
    return links


def source_path(line: str, links: dict[Path, Path]) -> str:
    """An error line with the laid-out path written as the source file's."""
    for link, source in sorted(links.items(), key=lambda item: -len(str(item[0]))):
        prefix = str(link.relative_to(ROOT))
        if line.startswith(prefix):
            return str(source.relative_to(ROOT)) + line[len(prefix) :]
    return line


def main(packages: list[str]) -> int:
    links = lay_out(TREE)
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    for package in packages or CHECKED:
        command += ["-p", package]
    environment = {**os.environ, "MYPYPATH": str(TREE.relative_to(ROOT))}
    done = subprocess.run(
        command, cwd=ROOT, env=environment, capture_output=True, text=True, check=False
    )
    for line in (done.stdout + done.stderr).splitlines():
        print(source_path(line, links))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
