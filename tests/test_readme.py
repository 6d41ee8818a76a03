"""The README states what the code holds: the layers with a closed-form rule (and no
other), the reasons a layer takes the generic route, what the engine refuses, every
reduction, every reduction option; and the pages statements moved to (docs/operations.md,
docs/engine.md) hold theirs: every `pergrad serve` flag, the bounds, the tolerances."""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pergrad.server import engine
from pergrad.server.admission.limits import REFUSED_BYTES, REFUSED_WINDOW_S
from pergrad.server.config import AUTO_REQUEST_BYTES, add_arguments
from pergrad.server.engine.rules import LayerRegistry, default_registry
from pergrad.wire.catalogue import CATALOGUE
from pergrad.wire.chunked_requests import MESSAGE_BYTES
from tests.conftest import ROOT
from tests.helpers import LOOP_ERROR_FACTOR, RELATIVE_TOLERANCE

README = (ROOT / "README.md").read_text()
# The operator's manual and the engine's notes: statements moved out of the README are
# held where they now stand.
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
ENGINE_NOTES = (ROOT / "docs" / "engine.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def _route_cell(route: str) -> str:
    """The layers cell of the engine section's table row for `route`."""
    row = next(line for line in _section("Engine").splitlines() if line.startswith(f"| {route}"))
    return row.strip().strip("|").split("|")[1].strip()


def _quoted(text: str) -> list[str]:
    """The engine's messages the text quotes, each "in double quotes"."""
    return re.findall(r'"([^"]+)"', " ".join(text.split()))


def _messages(function: Callable[..., Any]) -> list[ast.expr]:
    """The (non-empty) string literals and f-strings `function` returns, however nested
    in its return values."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    found: list[ast.expr] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.JoinedStr) or (
            isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value
        ):
            found.append(node)
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    for node in ast.walk(tree):
        if isinstance(node, ast.Return) and node.value is not None:
            visit(node.value)
    return found


def _pattern(message: ast.expr) -> re.Pattern[str]:
    """A message as a pattern: its literal text, each interpolated value one word."""
    if isinstance(message, ast.Constant):
        return re.compile(re.escape(message.value))
    parts = [
        re.escape(part.value) if isinstance(part, ast.Constant) else r"\S+"
        for part in message.values
    ]
    return re.compile("".join(parts))


def _literal_parts(message: ast.expr | None) -> list[str]:
    """The literal text of a message (a string or an f-string; nothing of anything else)."""
    if isinstance(message, ast.Constant) and isinstance(message.value, str):
        return [message.value]
    if isinstance(message, ast.JoinedStr):
        return [part.value for part in message.values if isinstance(part, ast.Constant)]
    return []


def test_the_engine_section_names_every_layer_with_a_rule() -> None:
    """The row lists layer classes, each with its notes in parentheses: the classes are
    exactly those of `default_registry()`, so it names none without a rule."""
    cell = re.sub(r"`[^`]*`", "", _route_cell("closed form"))
    while re.search(r"\([^()]*\)", cell):
        cell = re.sub(r"\([^()]*\)", "", cell)
    listed = [item.split()[-1] for item in cell.split(",")]
    names = default_registry().names()
    assert sorted(listed) == names, f"README lists {sorted(listed)}; rules exist for {names}"


def test_the_generic_row_quotes_every_reason_the_plan_gives() -> None:
    """The plan sends a layer's variables to the generic route for one of the reasons
    `LayerRegistry.lookup` returns: no rule for its class, or its rule's `applies()`
    reason. The row quotes each (as the server logs it) and quotes nothing else; a
    class it says has no rule has none."""
    registry = default_registry()
    sources = [
        LayerRegistry._probed,
        *{id(r.applies): r.applies for r in registry._rules.values()}.values(),
    ]
    reasons = {ast.unparse(m): _pattern(m) for source in sources for m in _messages(source)}
    quoted = _quoted(_route_cell("generic"))
    unknown = [q for q in quoted if not any(p.fullmatch(q) for p in reasons.values())]
    assert not unknown, f"README's generic row quotes reasons the plan never gives: {unknown}"
    missing = [code for code, p in reasons.items() if not any(p.fullmatch(q) for q in quoted)]
    assert not missing, f"README's generic row does not quote the reasons {missing}"
    (no_rule,) = _messages(LayerRegistry._probed)
    prefix = _literal_parts(no_rule)[0]
    named = [q.removeprefix(prefix) for q in quoted if q.startswith(prefix)]
    ruled = sorted(set(registry.names()) & set(named))
    assert named and not ruled, f"README says these have no rule: {ruled}"


def _engine_refusals() -> list[tuple[str, ast.expr | None]]:
    """Every `raise ValueError(message)` in the engine package: what it refuses (a model,
    a loss, an argument). A request's bad batch or options raise InvalidArgument."""
    found = []
    for path in sorted(Path(engine.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            call = node.exc if isinstance(node, ast.Raise) else None
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "ValueError":
                found.append((f"{path.name}:{node.lineno}", (call.args or [None])[0]))
    return found


def test_the_refused_list_quotes_every_refusal_of_the_engine() -> None:
    """The engine notes' "Refused models" paragraph quotes, from each message the engine
    refuses with, some of its literal text; and quotes nothing the engine never says."""
    paragraph = next(p for p in ENGINE_NOTES.split("\n\n") if p.startswith("**Refused models"))
    quoted = _quoted(paragraph)
    refusals = _engine_refusals()
    assert refusals
    said = [part for _, message in refusals for part in _literal_parts(message)]
    unknown = [q for q in quoted if not any(q in part for part in said)]
    assert not unknown, f"the refused list quotes what the engine never says: {unknown}"
    missing = [
        where
        for where, message in refusals
        if not any(q in part for q in quoted for part in _literal_parts(message))
    ]
    assert not missing, f"the refused list quotes nothing of the refusals at {missing}"


def test_every_reduction_and_option_is_in_the_readme() -> None:
    client = _section("Client")
    for reduction in CATALOGUE.reductions.values():
        assert f'`"{reduction.name}"`' in client, reduction.name
        for option in reduction.options:
            assert option.name in client, (reduction.name, option.name)


def test_every_serve_flag_is_in_the_operators_manual() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings[0] != "-h"]
    missing = [flag for flag in flags if flag not in OPERATIONS]
    assert not missing, f"docs/operations.md does not mention {missing}"


def test_the_engine_notes_state_the_tolerances_the_tests_hold() -> None:
    """docs/engine.md's accuracy statement is the tests' contract, number for number."""
    text = " ".join(ENGINE_NOTES.split())
    contract = f"{RELATIVE_TOLERANCE:.0e}".replace("e-0", "e-")  # as the README writes it
    assert f"within {contract} of its largest entry" in text
    assert f"max({contract}, {LOOP_ERROR_FACTOR}·e)" in text


def test_the_operators_manual_states_the_refused_bytes_budget_the_guard_holds() -> None:
    text = " ".join(OPERATIONS.split())
    assert f"{REFUSED_BYTES >> 20} MiB of them in any {REFUSED_WINDOW_S:g} s" in text


def test_the_operators_manual_states_the_auto_request_bound_and_the_message_bound() -> None:
    text = " ".join(OPERATIONS.split())
    assert f"auto, the default, is {AUTO_REQUEST_BYTES >> 20} MiB plus" in text
    assert f"one message is {MESSAGE_BYTES >> 20} MiB at most" in text
