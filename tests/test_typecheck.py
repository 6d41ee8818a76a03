"""`make lint`'s type check (scripts/typecheck.py) reads the package as it installs."""

from __future__ import annotations

import importlib.util
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
typecheck = runpy.run_path(str(ROOT / "scripts" / "typecheck.py"))


def test_each_import_name_is_laid_out_where_the_installed_package_finds_it(
    tmp_path: Path,
) -> None:
    typecheck["lay_out"](tmp_path)
    for name in typecheck["package_dirs"]():
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None
        laid = tmp_path.joinpath(*name.split("."), "__init__.py")
        assert laid.resolve() == Path(spec.origin).resolve(), name


def test_an_error_is_named_by_the_source_file_it_is_in() -> None:
    links = {ROOT / "build" / "typecheck" / "pergrad" / "server": ROOT / "server"}
    line = "build/typecheck/pergrad/server/engine/grads.py:57: error: something"
    assert typecheck["source_path"](line, links) == "server/engine/grads.py:57: error: something"
