"""The import rules of docs/architecture.md, checked on the code as it is.

Loaded modules are read in a fresh interpreter (`sys.modules` after one import); the
static rules are read from every module's import statements.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

TENSORFLOW = ("tensorflow", "keras")
# (module imported, top-level prefixes it must not load)
LOADED_RULES = [
    ("pergrad.client", (*TENSORFLOW, "pergrad.server")),
    ("pergrad.cli", (*TENSORFLOW, "pergrad.server")),
    ("pergrad.wire.codec", (*TENSORFLOW, "grpc", "pergrad.server", "pergrad.client")),
    ("pergrad.wire.messages", (*TENSORFLOW, "grpc", "pergrad.server", "pergrad.client")),
    ("pergrad.wire.catalogue", ("numpy", "google.protobuf", "pergrad.v1", "grpc")),
    ("pergrad.wire.results", ("google.protobuf", "pergrad.v1", "grpc", *TENSORFLOW)),
    ("pergrad.server.engine", ("grpc", "pergrad.v1", "pergrad.client")),
]


def _loaded(module: str) -> list[str]:
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return run.stdout.split()


@pytest.mark.parametrize(("module", "forbidden"), LOADED_RULES, ids=[m for m, _ in LOADED_RULES])
def test_importing_a_module_loads_nothing_it_must_not(module: str, forbidden: tuple) -> None:
    bad = [m for m in _loaded(module) if m.startswith(forbidden) and not m.endswith("_pywrap")]
    bad = [m for m in bad if any(m == f or m.startswith(f + ".") for f in forbidden)]
    assert not bad, f"{module} loads {sorted(bad)[:10]}"


def _sources() -> dict[str, Path]:
    """Import name -> file of every module under the folders pyproject maps."""
    import tomllib

    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    found = {}
    for name, folder in package_dir.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            module = ".".join((name, *parts)).removesuffix(".__init__")
            found[module] = path
    return found


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


SOURCES = _sources()


def _importers(target: str) -> list[str]:
    return sorted(
        module
        for module, path in SOURCES.items()
        if any(i == target or i.startswith(target + ".") for i in _imports(path))
    )


def test_no_module_outside_the_client_imports_its_private_modules() -> None:
    offenders = [
        (module, imported)
        for module, path in SOURCES.items()
        if not module.startswith("pergrad.client")
        for imported in _imports(path)
        if imported.startswith("pergrad.client._")
    ]
    assert not offenders


def test_the_client_and_the_wire_never_import_the_server_or_the_cli() -> None:
    for module in _importers("pergrad.server") + _importers("pergrad.cli"):
        assert not module.startswith(("pergrad.client", "pergrad.wire")), module


# What rules and reductions may import of pergrad: the small types they share.
LEAF_ALLOWED = (
    "pergrad.server.engine.grads",
    "pergrad.server.engine.layers",
    "pergrad.server.engine.rules",
    "pergrad.server.engine.reductions",
    "pergrad.server.errors",
)


@pytest.mark.parametrize("package", ["rules", "reductions"])
def test_rules_and_reductions_import_nothing_above_them(package: str) -> None:
    prefix = f"pergrad.server.engine.{package}"
    for module, path in SOURCES.items():
        if not module.startswith(prefix):
            continue
        ours = [i for i in _imports(path) if i.startswith("pergrad.")]
        above = [i for i in ours if not i.startswith(LEAF_ALLOWED)]
        assert not above, f"{module} imports {above}"


def test_the_engine_imports_nothing_of_the_service_or_the_models() -> None:
    for module, path in SOURCES.items():
        if module.startswith("pergrad.server.engine"):
            ours = [i for i in _imports(path) if i.startswith("pergrad.")]
            assert not [
                i
                for i in ours
                if i.startswith(
                    (
                        "pergrad.server.models",
                        "pergrad.server.service",
                        "pergrad.client",
                        "pergrad.v1",
                    )
                )
            ]
