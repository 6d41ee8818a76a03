"""Packages are discovered, never listed: every package under each folder that
pyproject.toml's `[tool.setuptools.package-dir]` maps to an import name ships."""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import find_packages, setup

if sys.version_info >= (3, 11):
    import tomllib
else:  # build-system requires tomli there
    import tomli as tomllib


def discovered_packages() -> list[str]:
    config = tomllib.loads(Path(__file__).with_name("pyproject.toml").read_text())
    package_dir = config["tool"]["setuptools"]["package-dir"]
    found = []
    for name, folder in package_dir.items():
        found += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]
    return found


setup(packages=discovered_packages())
