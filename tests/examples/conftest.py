"""Fixtures of the example tests; the examples' folder goes on sys.path so that the tests
import an example's functions (and its `_common` module) just as the script does."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from pergrad.client import GradientClient
from tests.examples.helpers import EXAMPLES, fresh_target

sys.path.insert(0, str(EXAMPLES))


@pytest.fixture()
def target() -> Iterator[str]:
    with fresh_target() as address:
        yield address


@pytest.fixture()
def client(target: str) -> Iterator[GradientClient]:
    with GradientClient(target, timeout=60) as c:
        yield c
