"""The flags' table: every setting of Config one flag, and the operator's docs show them."""

from __future__ import annotations

from dataclasses import fields

from pergrad.server.config import Config
from pergrad.server.flags import FLAGS, markdown
from tests.conftest import ROOT


def test_every_setting_is_one_flag_and_one_variable() -> None:
    assert sorted(flag.attr for flag in FLAGS) == sorted(field.name for field in fields(Config))
    assert len({flag.flag for flag in FLAGS}) == len(FLAGS)
    assert len({flag.variable for flag in FLAGS}) == len(FLAGS)


def test_the_operators_docs_show_every_flag_as_it_is() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    assert markdown() in text, "docs/operations.md: paste flags.markdown() in place of its table"
