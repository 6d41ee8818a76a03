"""Prints the model zoo (tests/zoo.py) as a table: each family's route and its largest
error against the Keras-only batch-size-1 loop (tests/oracle.py), as the zoo tests check.

    .venv/bin/python scripts/zoo_table.py

Error: the tests' contract (tests/helpers.relative_errors): the largest error of a tensor
relative to its reference's largest entry (floored at 1e-2 of the largest of all), over
the full per-example gradients where the family is small enough, else over the per-example
norms against the oracle run in float64; in float32. The bound is the one the tests hold
(tests/helpers.py, stated in the README's Engine section).
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
from tests.helpers import RELATIVE_TOLERANCE, float64_tolerances, relative_errors
from tests.zoo import FAMILIES


def row(name: str) -> str:
    family = FAMILIES[name]
    model, loss = family.build()
    compiled = getattr(model, "loss", None)
    engine = Engine(
        model, loss=None if compiled is not None else loss, jit_compile=family.jit_compile
    )
    x, y = family.batch(model, family.size)
    if family.full:
        _, grads = oracle.per_example(model, loss, x, y)
        result = engine.per_example_gradients(x, y)
        error = max(relative_errors(result.gradients, grads).values())
        checked, bound = "full gradients", RELATIVE_TOLERANCE
    else:
        twin = oracle.in_float64(family.build, model)
        _, grads = oracle.per_example(twin, loss, np.asarray(x, np.float64), y)
        _, float32_grads = oracle.per_example(model, loss, x, y)
        result = engine.per_example_gradients(x, y, reduction="norms")
        norms = {"norms": oracle.per_example_norms(grads)}
        loop = {"norms": oracle.per_example_norms(float32_grads)}
        error = max(relative_errors({"norms": result.norms}, norms).values())
        checked, bound = "norms (float64 loop)", float64_tolerances(loop, norms)["norms"]
    fallback = sorted({why for _, why in engine.plan.reasons})
    route = "closed form" if not engine.plan.fallback else "generic for " + "; ".join(fallback)
    return f"| {name} | {route} | {checked} | {error:.1e} | {bound:.1e} |"


def main() -> None:
    print("| family | route | checked | max relative error | bound (README) |")
    print("| --- | --- | --- | ---: | ---: |")
    for name in sorted(FAMILIES):
        print(row(name), flush=True)


if __name__ == "__main__":
    main()
