"""The README states what the code holds: every layer with a closed-form rule, every
reduction, every reduction option, every `pergrad serve` flag."""

from __future__ import annotations

import argparse

from pergrad.server.config import add_arguments
from pergrad.server.engine.rules import default_registry
from pergrad.wire.catalogue import CATALOGUE
from tests.conftest import ROOT

README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end > 0 else None]


def test_the_engine_section_names_every_layer_with_a_rule() -> None:
    closed_form = next(
        line for line in _section("Engine").splitlines() if line.startswith("| closed form")
    )
    names = {layer.__name__ for layer in default_registry()._rules}
    missing = sorted(name for name in names if name not in closed_form)
    assert not missing, f"README's engine section does not list {missing}"


def test_every_reduction_and_option_is_in_the_readme() -> None:
    client = _section("Client")
    for reduction in CATALOGUE.reductions.values():
        assert f'`"{reduction.name}"`' in client, reduction.name
        for option in reduction.options:
            assert option.name in client, (reduction.name, option.name)


def test_every_serve_flag_is_in_the_readme() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings[0] != "-h"]
    missing = [flag for flag in flags if flag not in README]
    assert not missing, f"README does not mention {missing}"
