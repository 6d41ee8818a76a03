"""Server-side reductions of per-example gradients: each answers without B x P on the wire.

A reduction sees the selected variables' per-example gradients slice by slice
(`add`, factored where a rule allows) and returns its result fields (`finish`):

    norms        norms [B], variable_norms {name: [B]}
    clipped_sum  clipped_sum {name: var-shaped}, norms [B], num_clipped  (DP-SGD step)
    moments      sum, sum_squares {name: var-shaped}                     (diagonal Fisher)
    dot          dots [B, K] against K reference gradients               (TracIn)
    project      projections [B, dim], a seeded random projection        (TRAK)

Each lives in a module of its own; `make_reduction` validates the options.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from pergrad.server.engine.grads import Grad
from pergrad.server.errors import InvalidArgument

NONE = "none"
NAMES = (NONE, "norms", "clipped_sum", "moments", "dot", "project")


class Selected(Protocol):
    """A variable a reduction covers: its position in the model's order, name, shape."""

    index: int
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]


class Reduction(Protocol):
    def add(self, grads: Mapping[str, Grad]) -> None: ...

    def finish(self) -> dict[str, Any]: ...


def make_reduction(
    name: str, variables: Sequence[Selected], options: Mapping[str, Any]
) -> Reduction:
    from pergrad.server.engine.reductions import clipped_sum, dot, moments, norms, project

    makers = {
        "norms": norms.Norms,
        "clipped_sum": clipped_sum.ClippedSum,
        "moments": moments.Moments,
        "dot": dot.Dot,
        "project": project.Project,
    }
    if name not in makers:
        raise InvalidArgument(f"reduction: unknown {name!r}; known: {', '.join(NAMES)}")
    accepted = set(inspect.signature(makers[name]).parameters) - {"variables"}
    if unknown := sorted(set(options) - accepted):
        raise InvalidArgument(
            f"{unknown}: not options of reduction {name!r}, which takes {sorted(accepted)}"
        )
    return makers[name](variables, **options)
