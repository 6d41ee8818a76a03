"""Prints the model zoo (tests/zoo.py) as a table: each family's route and its largest
error against the Keras-only batch-size-1 loop (tests/oracle.py), as the zoo tests check.

    .venv/bin/python scripts/zoo_table.py

Error: max over values of |engine - oracle| / (|oracle| + 1e-6 * max |oracle|), for the
full per-example gradients where the family is small enough, else for the per-example
norms; in float32.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from pergrad.server.engine import Engine
from tests import oracle
from tests.zoo import FAMILIES


def _error(got: np.ndarray, want: np.ndarray) -> float:
    want = np.asarray(want, np.float64)
    floor = 1e-6 * max(float(np.abs(want).max()), 1e-30)
    return float((np.abs(np.asarray(got, np.float64) - want) / (np.abs(want) + floor)).max())


def row(name: str) -> str:
    family = FAMILIES[name]
    model, loss = family.build()
    compiled = getattr(model, "loss", None)
    engine = Engine(
        model, loss=None if compiled is not None else loss, jit_compile=family.jit_compile
    )
    x, y = family.batch(model, family.size)
    _, grads = oracle.per_example(model, loss, x, y)
    if family.full:
        result = engine.per_example_gradients(x, y)
        error = max(_error(result.gradients[k], g) for k, g in grads.items())
        checked = "full gradients"
    else:
        result = engine.per_example_gradients(x, y, reduction="norms")
        error = _error(result.norms, oracle.per_example_norms(grads))
        checked = "norms"
    fallback = sorted({why for _, why in engine.plan.reasons})
    route = "closed form" if not engine.plan.fallback else "generic for " + "; ".join(fallback)
    return f"| {name} | {route} | {checked} | {error:.1e} |"


def main() -> None:
    print("| family | route | checked | max relative error |")
    print("| --- | --- | --- | ---: |")
    for name in sorted(FAMILIES):
        print(row(name), flush=True)


if __name__ == "__main__":
    main()
