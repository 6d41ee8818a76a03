"""The wheel's contents, derived from the source tree: every module ships, nothing else does."""

from __future__ import annotations

import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement

from tests.conftest import ROOT, package_dir

# Folders that never ship; every other top-level folder holding a package must be mapped.
NOT_SHIPPED = {"tests", "benchmarks", "examples", "deploy", "build", "dist"}


def _source_files() -> dict[str, Path]:
    """Wheel path -> source file of every file under the mapped folders (modules, the
    .proto files, their descriptors) but Python's caches."""
    expected = {}
    for name, folder in package_dir().items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                relative = path.relative_to(ROOT / folder).as_posix()
                expected[f"{name.replace('.', '/')}/{relative}"] = path
    return expected


def _names(wheel: Path) -> set[str]:
    return set(zipfile.ZipFile(wheel).namelist())


def _metadata(wheel: Path):
    archive = zipfile.ZipFile(wheel)
    name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    return Parser().parsestr(archive.read(name).decode())


def test_every_module_of_the_source_tree_is_in_the_wheel(wheel: Path) -> None:
    missing = sorted(set(_source_files()) - _names(wheel))
    assert not missing, f"modules missing from the wheel: {missing}"


def test_wheel_holds_the_source_files_unchanged(wheel: Path) -> None:
    archive = zipfile.ZipFile(wheel)
    changed = [n for n, p in _source_files().items() if archive.read(n) != p.read_bytes()]
    assert not changed


def test_wheel_holds_nothing_but_pergrad_and_its_metadata(wheel: Path) -> None:
    stray = [n for n in _names(wheel) if not n.startswith(("pergrad/", "pergrad-"))]
    tests = [n for n in _names(wheel) if Path(n).name.startswith(("test_", "conftest"))]
    assert not stray and not tests, stray + tests


def test_every_top_level_package_folder_is_mapped() -> None:
    """A component folder added without a package-dir line would silently not ship."""
    mapped = {Path(folder).parts[0] for folder in package_dir().values()}
    folders = {
        folder.name
        for folder in ROOT.iterdir()
        if folder.is_dir()
        and not folder.name.startswith(".")
        and folder.name not in NOT_SHIPPED
        and next(folder.rglob("__init__.py"), None)
    }
    assert folders <= mapped, f"not mapped in pyproject.toml package-dir: {folders - mapped}"


def test_tensorflow_is_only_in_the_server_extra(wheel: Path) -> None:
    requirements = [Requirement(r) for r in _metadata(wheel).get_all("Requires-Dist")]
    base = [r.name for r in requirements if r.marker is None]
    server = [r.name for r in requirements if r.marker and r.marker.evaluate({"extra": "server"})]
    assert "tensorflow" not in base and "keras" not in base
    assert {"tensorflow", "keras", "prometheus-client"} <= set(server)
