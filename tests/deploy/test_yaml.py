"""Every YAML file under deploy/ is yamllint-clean with the repository's .yamllint."""

from __future__ import annotations

from pathlib import Path

import pytest
from yamllint import linter
from yamllint.config import YamlLintConfig

from tests.prometheus import DEPLOY, ROOT

YAML_FILES = sorted(p for p in DEPLOY.rglob("*") if p.suffix in {".yaml", ".yml"})


def test_deploy_has_yaml_files() -> None:
    assert len(YAML_FILES) >= 15


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: str(p.relative_to(DEPLOY)))
def test_yaml_file_is_yamllint_clean(path: Path) -> None:
    config = YamlLintConfig(file=str(ROOT / ".yamllint"))
    problems = [
        f"{path.relative_to(ROOT)}:{p.line}:{p.column} {p.level} {p.desc} ({p.rule})"
        for p in linter.run(path.read_text(), config, str(path))
    ]
    assert not problems, "\n".join(problems)
