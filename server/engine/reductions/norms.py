"""NORMS: each example's gradient L2 norm, whole and per variable, never forming it.

Computed inside the pass (`in_pass`, float32) when a request has its passes to itself;
from the numpy factors (float64) when it shares them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from pergrad.server.engine.grads import Grad
from pergrad.server.engine.reductions import summed
from pergrad.server.engine.reductions.factored import squared_norms
from pergrad.server.engine.slices import VariableSpec


def squared(variables: Sequence[VariableSpec], grads: Mapping[str, Grad]) -> dict[str, np.ndarray]:
    return {v.name: squared_norms(grads[v.name], v.shape, v.dtype) for v in variables}


class Norms:
    IN_PASS_CLIP = False
    max_norm = 0.0  # clips nothing

    def __init__(self, variables: Sequence[VariableSpec]) -> None:
        self._variables = variables
        self._parts: list[dict[str, np.ndarray]] = []

    def add(self, grads: Mapping[str, Grad]) -> None:
        self._parts.append(squared(self._variables, grads))

    def add_in_pass(
        self, squares: Mapping[str, np.ndarray], sums: Mapping[str, np.ndarray]
    ) -> None:
        """One slice's squared norms per variable, from the pass itself."""
        self._parts.append(dict(squares))

    def finish(self) -> dict[str, Any]:
        per_variable = {
            v.name: np.concatenate([p[v.name] for p in self._parts]) for v in self._variables
        }
        total = summed(per_variable.values())
        return {
            "norms": np.sqrt(total).astype(np.float32),
            "variable_norms": {k: np.sqrt(s).astype(np.float32) for k, s in per_variable.items()},
        }


REDUCTION = Norms
