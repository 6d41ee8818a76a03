"""The import rules of docs/architecture.md, checked on the code as it is.

Loaded modules are read in a fresh interpreter (`sys.modules` after importing each module
of a package, the modules found by walking the source tree, so a module loaded only
lazily, by name, is checked too); the static rules are read from every module's import
statements (relative imports resolved, imports inside functions included).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tests.conftest import ROOT, package_dir

TENSORFLOW = ("tensorflow", "keras")


def _sources() -> dict[str, Path]:
    """Import name -> file of every module under the folders pyproject maps."""
    found = {}
    for name, folder in package_dir().items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            module = ".".join((name, *parts)).removesuffix(".__init__")
            found[module] = path
    return found


SOURCES = _sources()


def _under(package: str) -> list[str]:
    """`package` and every module in it, from the source tree."""
    return sorted(m for m in SOURCES if m == package or m.startswith(package + "."))


def _is(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _repo_file(name: str) -> Path | None:
    """The file of this repository that importing the module `name` runs, if any."""
    if name in SOURCES:
        return SOURCES[name]
    parts = name.split(".")
    for path in (ROOT.joinpath(*parts).with_suffix(".py"), ROOT.joinpath(*parts, "__init__.py")):
        if path.is_file():
            return path
    return None


def _imports(path: Path, module: str) -> set[str]:
    """The modules `module` (at `path`) imports by name, relative imports resolved:
    `from a import b` names the module a.b if there is one, else a."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                names.add(submodule if _repo_file(submodule) else base)
    return names


# --- what importing a module loads -----------------------------------------------------


@cache
def _loaded_by(modules: tuple[str, ...]) -> dict[str, list[str]]:
    """module -> what importing it added to `sys.modules`, importing `modules` in order in
    one fresh interpreter (run in the repository, so `tests.*` imports too). The union
    of the lists is everything the modules load; a module's list names what it brought."""
    code = (
        "import importlib, json, sys\n"
        "added = {}\n"
        f"for name in {list(modules)!r}:\n"
        "    before = set(sys.modules)\n"
        "    importlib.import_module(name)\n"
        "    added[name] = sorted(set(sys.modules) - before)\n"
        "print(json.dumps(added))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
        cwd=ROOT,
    )
    return json.loads(run.stdout.splitlines()[-1])


def _forbidden_loads(modules: list[str], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    loaded = _loaded_by(tuple(modules))
    bad = {m: [n for n in names if _is(n, forbidden)] for m, names in loaded.items()}
    return {m: names[:10] for m, names in bad.items() if names}


def _importable(package: str) -> list[str]:
    # A `__main__` module runs its command when imported (`python -m` is its only use):
    # it is not imported here; `test_main_modules_import_only_what_is_checked` holds it.
    return [m for m in _under(package) if not m.endswith(".__main__")]


def _main_modules() -> list[str]:
    return [m for m in SOURCES if m.endswith(".__main__")]


# (package, what none of its modules may load)
PACKAGE_RULES = [
    ("pergrad.client", (*TENSORFLOW, "pergrad.server", "pergrad.cli")),
    ("pergrad.cli", (*TENSORFLOW, "pergrad.server")),
]


@pytest.mark.parametrize(("package", "forbidden"), PACKAGE_RULES, ids=[p for p, _ in PACKAGE_RULES])
def test_no_module_of_the_client_or_the_cli_loads_tensorflow_or_the_server(
    package: str, forbidden: tuple[str, ...]
) -> None:
    modules = _importable(package)
    assert len(modules) > 1, f"found no modules of {package}"
    bad = _forbidden_loads(modules, forbidden)
    assert not bad, f"these modules of {package} load what they must not: {bad}"


def test_main_modules_import_only_what_is_checked() -> None:
    """What a `__main__` module imports of pergrad is a module the load checks import."""
    for module in _main_modules():
        package = module.removesuffix(".__main__")
        ours = {i for i in _imports(SOURCES[module], module) if i.startswith("pergrad")}
        unchecked = sorted(i for i in ours if i in SOURCES and not _is(i, (package,)))
        assert not unchecked, f"{module} imports {unchecked}, outside {package}"
        others = _imports(SOURCES[module], module) - ours
        assert not [i for i in others if _is(i, (*TENSORFLOW, "grpc"))], module


WIRE_FORBIDDEN = (*TENSORFLOW, "grpc", "pergrad.server", "pergrad.client", "pergrad.cli")
# Modules of pergrad.wire with stricter rules: the engine imports these, and they load no
# generated code (pergrad.v1) and no protobuf (catalogue and terms: numpy only through
# casting, which checks a tensors option's arrays as it checks inputs).
WIRE_STRICTER = {
    "pergrad.wire.catalogue": ("google.protobuf", "pergrad.v1"),
    "pergrad.wire.terms": ("google.protobuf", "pergrad.v1"),
    "pergrad.wire.results": ("google.protobuf", "pergrad.v1"),
    "pergrad.wire.casting": ("google.protobuf", "pergrad.v1"),
    "pergrad.wire.text": ("google.protobuf", "pergrad.v1", "numpy"),
}
WIRE_MODULES = _importable("pergrad.wire")


def test_the_wire_modules_with_stricter_rules_exist() -> None:
    assert set(WIRE_STRICTER) <= set(WIRE_MODULES)
    assert len(WIRE_MODULES) > len(WIRE_STRICTER)


@pytest.mark.parametrize("module", WIRE_MODULES)
def test_no_wire_module_loads_grpc_or_tensorflow(module: str) -> None:
    # One interpreter per module: each is checked for what it alone loads.
    forbidden = (*WIRE_FORBIDDEN, *WIRE_STRICTER.get(module, ()))
    bad = _forbidden_loads([module], forbidden)
    assert not bad, f"{module} loads {bad[module]}"


ENGINE_MODULES = _importable("pergrad.server.engine")
ORACLE = "tests.oracle"  # the tests' independent reference (Keras only)
ENGINE_FORBIDDEN = ("grpc", "pergrad.v1", "pergrad.client", "pergrad.cli")


def test_no_engine_module_loads_grpc_the_protos_or_the_client() -> None:
    """Every module under pergrad.server.engine, rules and reductions included (the
    engine finds those by name, so importing the engine alone would not load them)."""
    for lazily_found in ("rules", "reductions"):
        prefix = f"pergrad.server.engine.{lazily_found}."
        assert any(m.startswith(prefix) for m in ENGINE_MODULES), lazily_found
    # The oracle is imported first, in the same interpreter (it loads TensorFlow, which
    # one interpreter then loads once): it must not load these either, or an engine
    # module loading them would go unseen.
    bad = _forbidden_loads([ORACLE, *ENGINE_MODULES], ENGINE_FORBIDDEN)
    assert not bad, f"these engine modules load what they must not: {bad}"


# --- the oracle ------------------------------------------------------------------------


def test_the_oracle_imports_nothing_of_pergrad() -> None:
    """tests/oracle.py is the independent reference: neither it nor anything of this
    repository it imports (transitively) may import pergrad."""
    chains = {ORACLE: [ORACLE]}
    todo = [ORACLE]
    while todo:
        module = todo.pop()
        for name in sorted(_imports(_repo_file(module), module)):
            assert not _is(name, ("pergrad",)), f"{' -> '.join(chains[module])} imports {name}"
            parts = name.split(".")
            # Importing a.b runs a's __init__ too.
            for prefix in (".".join(parts[:n]) for n in range(1, len(parts) + 1)):
                if prefix not in chains and _repo_file(prefix):
                    chains[prefix] = [*chains[module], prefix]
                    todo.append(prefix)


def test_loading_the_oracle_loads_nothing_of_pergrad() -> None:
    loaded = _loaded_by((ORACLE, *ENGINE_MODULES))[ORACLE]
    assert not [m for m in loaded if _is(m, ("pergrad",))]


# --- static rules ----------------------------------------------------------------------


def _importers(target: str) -> list[str]:
    return sorted(
        module
        for module, path in SOURCES.items()
        if any(_is(i, (target,)) for i in _imports(path, module))
    )


def test_no_module_outside_the_client_imports_its_private_modules() -> None:
    offenders = [
        (module, imported)
        for module, path in SOURCES.items()
        if not module.startswith("pergrad.client")
        for imported in _imports(path, module)
        if imported.startswith("pergrad.client._")
    ]
    assert not offenders


def test_the_client_and_the_wire_never_import_the_server_or_the_cli() -> None:
    for module in _importers("pergrad.server") + _importers("pergrad.cli"):
        assert not _is(module, ("pergrad.client", "pergrad.wire")), module


# What a rule or a reduction may import of pergrad: the small types they share, and its
# own package (rules do not import reductions, nor reductions rules).
LEAF_SHARED = (
    "pergrad.server.engine.cores",
    "pergrad.server.engine.flat_call",
    "pergrad.server.engine.grads",
    "pergrad.server.engine.layers",
    "pergrad.server.engine.patches",
    "pergrad.server.engine.slices",
    "pergrad.server.errors",
)
LEAF_NEVER = ("grpc", "google.protobuf")


@pytest.mark.parametrize("package", ["rules", "reductions"])
def test_rules_and_reductions_import_nothing_above_them(package: str) -> None:
    own = f"pergrad.server.engine.{package}"
    modules = _under(own)
    assert len(modules) > 1, own
    for module in modules:
        imported = _imports(SOURCES[module], module)
        ours = [i for i in imported if _is(i, ("pergrad",))]
        above = [i for i in ours if not _is(i, (*LEAF_SHARED, own))]
        assert not above, f"{module} imports {above}"
        wire = [i for i in imported if _is(i, LEAF_NEVER)]
        assert not wire, f"{module} imports {wire}"


# What the engine may import of pergrad: itself, the errors it raises, and the wire modules
# that load no generated code (see WIRE_STRICTER).
ENGINE_ALLOWED = (
    "pergrad.server.engine",
    "pergrad.server.errors",
    "pergrad.wire.catalogue",
    "pergrad.wire.results",
    "pergrad.wire.casting",
    "pergrad.wire.text",
)


def test_the_engine_imports_nothing_of_the_service_the_models_or_the_protos() -> None:
    for module in _under("pergrad.server.engine"):
        imported = _imports(SOURCES[module], module)
        ours = [i for i in imported if _is(i, ("pergrad",))]
        outside = [i for i in ours if not _is(i, ENGINE_ALLOWED)]
        assert not outside, f"{module} imports {outside}"
        assert not [i for i in imported if _is(i, ("grpc",))], module


def _cycles() -> list[list[str]]:
    """The import cycles among the project's modules (imports read from the source, those
    only for type checking too: a cycle there is the same tangle to a reader)."""
    graph = {
        m: sorted(i for i in _imports(SOURCES[m], m) if i in SOURCES and i != m) for m in SOURCES
    }
    found, state = [], dict.fromkeys(graph, 0)  # 0 unseen, 1 on the path, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in graph[module]:
            if state[imported] == 1:
                found.append([*path[path.index(imported) :], imported])
            elif state[imported] == 0:
                visit(imported, [*path, imported])
        state[module] = 2

    for module in sorted(graph):
        if state[module] == 0:
            visit(module, [module])
    return found


def test_no_modules_import_each_other() -> None:
    assert _cycles() == []
