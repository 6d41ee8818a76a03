"""Server-side reductions of per-example gradients: each answers without B x P on the wire.

A reduction sees the selected variables' per-example gradients slice by slice
(`add`, factored where a rule allows) and returns its output fields (`finish`), as
`pergrad.wire.catalogue` declares them; its options arrive checked by the catalogue.

    norms        norms [B], variable_norms {name: [B]}
    clipped_sum  clipped_sum {name: var-shaped}, norms [B], num_clipped  (DP-SGD step)
    moments      sum, sum_squares {name: var-shaped}                     (diagonal Fisher)
    dot          dots [B, K] against K reference gradients               (TracIn)
    project      projections [B, dim], a seeded random projection        (TRAK)

Each lives in the module named after it, whose `REDUCTION` is the class; a new one is
found by its name, with no list to edit here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from pergrad.server.engine.grads import Grad


class Selected(Protocol):
    """A variable a reduction covers: its position in the model's order, name, shape."""

    index: int
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]


class Reduction(Protocol):
    def add(self, grads: Mapping[str, Grad]) -> None: ...

    def finish(self) -> dict[str, Any]: ...


Maker = Callable[..., Reduction]
# Reductions registered without a module of their own (tests).
REGISTERED: dict[str, Maker] = {}


def implementation(name: str) -> Maker:
    """The class of the reduction named `name`: registered, or `<name>.REDUCTION`."""
    if name in REGISTERED:
        return REGISTERED[name]
    return importlib.import_module(f"{__name__}.{name}").REDUCTION


def make_reduction(
    name: str, variables: Sequence[Selected], options: Mapping[str, Any]
) -> Reduction:
    """A reduction over `variables` with `options` the catalogue checked."""
    return implementation(name)(variables, **options)
