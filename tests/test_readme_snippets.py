"""Every Python snippet of the README runs as written, against a real server where it
names one, with the names it leaves to the reader's own code bound to ordinary numpy
data (float64 features and int64 labels, as numpy makes them)."""

from __future__ import annotations

from typing import Any

import dp_accounting
import numpy as np
import pytest
from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent

from pergrad.client import GradientClient
from pergrad.server.main import RunningServer
from tests.conftest import ROOT
from tests.helpers import tabular_model
from tests.zoo import dict_attention, tokens

README = (ROOT / "README.md").read_text()
SERVED = "localhost:50051"  # the address the snippets dial


def _snippets() -> list[tuple[int, str]]:
    """(line, code) of each ```python block."""
    found, lines = [], README.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == "```python"]
    for start in starts:
        end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
        found.append((start + 1, "\n".join(lines[start + 1 : end])))
    return found


SNIPPETS = _snippets()


def _names() -> dict[str, Any]:
    """What a snippet leaves to its reader: data shaped for mnist_mlp, a model of its own,
    a model of several inputs, the DP accountant's imports."""
    rng = np.random.default_rng(0)
    x, y = rng.random((256, 784)), rng.integers(0, 10, 256)
    model = tabular_model()
    features = model.inputs[0].shape[1]
    ids = tokens(8).astype(np.int64)
    return {
        "GradientClient": GradientClient,  # imported by the README's first snippet
        "np": np,
        "x": x,
        "y": y,
        "x2": rng.random((256, 784)),
        "y2": rng.integers(0, 10, 256),
        "batches": [(x[:64], y[:64]), (x[64:128], y[64:128])],
        "steps": 2,
        "dp_accounting": dp_accounting,
        "PoissonSampledDpEvent": PoissonSampledDpEvent,
        "GaussianDpEvent": GaussianDpEvent,
        "keras_model": model,
        "text_model": dict_attention()[0],
        "ids": ids,
        "mask": np.ones(ids.shape),
        "engine_data": (rng.random((8, features)), rng.integers(0, 3, 8)),
    }


@pytest.fixture()
def names() -> dict[str, Any]:
    return _names()


def test_the_readme_has_snippets_to_run() -> None:
    assert len(SNIPPETS) >= 4


@pytest.mark.parametrize(("line", "code"), SNIPPETS, ids=[f"line {line}" for line, _ in SNIPPETS])
def test_the_snippet_runs_as_written(
    line: int, code: str, names: dict[str, Any], fresh_server: RunningServer
) -> None:
    code = code.replace(SERVED, f"127.0.0.1:{fresh_server.port}")
    if "Engine(" in code:  # in-process: the reader's data fits the reader's model
        names["x"], names["y"] = names["engine_data"]
    exec(compile(code, f"README.md:{line}", "exec"), names)
